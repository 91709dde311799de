"""Multi-token prediction (MTP): Megatron's MTP block on the last pipeline stage (--mtp-num-layers),
its loss in training (--enable-mtp-training, scaled by --mtp-loss-scaling-factor), as slime runs it.

megatron-core 0.16.1's `GPTModel._postprocess` runs the MTP block whenever it is built and then
needs `labels` and returns the language-model loss instead of logits; slime patches Megatron to take
`mtp_kwargs` instead. tether replaces `_postprocess` on its own GPTModel instances (`install`) with
one that always returns the main logits (unchanged by the MTP block: it only reads the decoder's
hidden states) and runs the MTP block only when the forward is given `labels` (the next tokens)
and `loss_mask` (aligned with the logits), i.e. in an actor training step with
--enable-mtp-training. Like slime's patch, the MTP loss reaches the output layer's weight only
through the main loss (the MTP logits use a detached copy), and it joins the gradient through
Megatron's MTPLossAutoScaler, which Megatron's schedule scales by 1/micro-batches (and DDP averages
over data-parallel ranks): the step gradient gets `factor / N * mean MTP cross-entropy` per layer.
Each layer's loss (its mean over the micro-batch's trained tokens) is recorded for slime's metrics
`mtp_{k}_loss` and `mtp_loss` (their sum).

Alignment: MTP layer k (from 1) at position t predicts token t+1+k; its loss counts where that
token is a trained response token (Megatron's own convention: the mask aligned with `labels`).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from tether.train.model.megatron_cpu import quiet_megatron_imports

_RECORD = "_tether_mtp_losses"
_TRAIN = "_tether_mtp_train"


def is_mtp_param(name: str) -> bool:
    """A parameter of the MTP block (names as `GPTModel.named_parameters()` gives them)."""
    return name.startswith("mtp.") or ".mtp." in name


def install(model: Any, *, train: bool) -> bool:
    """Give a GPTModel built with an MTP block tether's post-process (see the module docstring);
    `train`: the MTP loss is computed in training steps (--enable-mtp-training). Returns whether the
    model has an MTP block (only the last pipeline stage has one)."""
    if not getattr(model, "mtp_process", False):
        return False
    model._postprocess = types.MethodType(_postprocess, model)
    setattr(model, _TRAIN, train)
    setattr(model, _RECORD, [])
    return True


def freeze(model: Any) -> int:
    """Without --enable-mtp-training the MTP block is not run and its weights stay as loaded (no
    gradient, so neither the optimizer nor weight decay touches them); returns how many were frozen."""
    count = 0
    for name, param in model.named_parameters():
        if is_mtp_param(name):
            param.requires_grad_(False)
            count += 1
    return count


def training_model(chunk: Any) -> Any | None:
    """The GPTModel in `chunk` if it trains an MTP block, else None."""
    from tether.train.model.bridge import unwrap

    model = unwrap(chunk)
    return model if getattr(model, _TRAIN, False) else None


def forward_inputs(
    tokens: torch.Tensor, response_index: torch.Tensor, loss_mask: torch.Tensor
) -> dict[str, Any]:
    """GPTModel.forward's `labels` (the next token at each position; 0 past the end) and `loss_mask`
    ([b, s], aligned with the logits: position t is 1 where the token t+1 is a trained response
    token) for a padded micro-batch: `response_index` are the flat positions whose logits predict
    the response tokens, `loss_mask` their mask (tether.train.rank.batching.MicroBatchTensors)."""
    labels = torch.roll(tokens, shifts=-1, dims=1)
    labels[:, -1] = 0
    full = torch.zeros(tokens.numel(), dtype=torch.float32, device=tokens.device)
    full[response_index.to(tokens.device)] = loss_mask.to(device=tokens.device, dtype=torch.float32)
    return {"labels": labels, "loss_mask": full.view_as(tokens)}


def reset(model: Any) -> None:
    getattr(model, _RECORD).clear()


def layer_losses(model: Any, cp_group: Any = None) -> list[float]:
    """Each MTP layer's loss, averaged over the micro-batches run since `reset` (slime's
    tracker values x 1/micro-batches); empty when none ran. `cp_group`: under context parallelism
    each rank holds a share of every micro-batch's tokens; their sums and counts are added up first,
    so the value is the micro-batch's mean over all of its tokens."""
    recorded: list[torch.Tensor] = getattr(model, _RECORD)
    if not recorded:
        return []
    sums_counts = torch.stack(recorded)  # [micro-batches, layers, 2]
    if cp_group is not None:
        torch.distributed.all_reduce(sums_counts, group=cp_group)
    means = sums_counts[..., 0] / sums_counts[..., 1].clamp(min=1.0)
    return [float(v) for v in means.mean(dim=0).cpu().tolist()]


def _roll(tensor: torch.Tensor, cp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with quiet_megatron_imports():
        from megatron.core.transformer.multi_token_prediction import roll_tensor

    rolled, total = roll_tensor(tensor, shifts=-1, dims=-1, cp_group=cp_group)
    return rolled, total


def _postprocess(
    self: Any,
    hidden_states: torch.Tensor,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    labels: torch.Tensor | None,
    rotary_pos_emb: Any,
    rotary_pos_cos: Any,
    rotary_pos_sin: Any,
    mtp_in_postprocess: Any = None,
    loss_mask: torch.Tensor | None = None,
    decoder_input: Any = None,
    attention_mask: Any = None,
    inference_params: Any = None,
    packed_seq_params: Any = None,
    sequence_len_offset: Any = None,
    runtime_gather_output: Any = None,
    extra_block_kwargs: Any = None,
    inference_context: Any = None,
) -> torch.Tensor:
    """GPTModel's post-process with the MTP block run only for a training forward given labels;
    returns the main logits [b, s, V/TP] always (see the module docstring)."""
    del mtp_in_postprocess, decoder_input, inference_context
    output_weight = (
        self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    )
    if labels is not None and self.training and getattr(self, _TRAIN, False):
        with quiet_megatron_imports():
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        layers = int(self.config.mtp_num_layers)
        stacked = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            embedding=self.embedding,
            **(extra_block_kwargs or {}),
        )
        parts = torch.chunk(stacked, 1 + layers, dim=0)
        hidden_states = parts[0]
        head = (output_weight if output_weight is not None else self.output_layer.weight).detach()
        targets = labels
        mask = loss_mask.float() if loss_mask is not None else torch.ones_like(labels, dtype=torch.float32)
        per_layer = []
        for k in range(layers):
            logits_k, _ = self.output_layer(
                parts[k + 1], weight=head, runtime_gather_output=runtime_gather_output
            )
            targets, _ = _roll(targets, self.cp_group)
            mask, count = _roll(mask, self.cp_group)
            token_loss = self.compute_language_model_loss(targets, logits_k) * mask
            per_layer.append(torch.stack([token_loss.sum(), count.float()]).detach())
            count = count.clamp(min=1.0)  # a micro-batch with nothing to train adds 0, not NaN
            scale = float(self.config.mtp_loss_scaling_factor) / layers
            added = scale * token_loss if self.config.calculate_per_token_loss else scale * token_loss / count
            hidden_states = MTPLossAutoScaler.apply(hidden_states, added)
        getattr(self, _RECORD).append(torch.stack(per_layer).float())  # read once per step
    if not self.post_process:
        return hidden_states
    logits, _ = self.output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    return logits.transpose(0, 1).contiguous()
