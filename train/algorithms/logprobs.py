"""Log-probs of the target tokens and entropy from vocab-parallel logits, never gathering the vocabulary.

With tensor parallelism each rank holds logits for its slice of the vocabulary. Log-probs come from
Megatron's `tensor_parallel.vocab_parallel_cross_entropy` (max and sum-exp all-reduced over the TP
group); entropy from `_VocabParallelEntropy` below (three all-reduces of one number per token). At
TP=1, or with no TP group, both are plain torch and need no Megatron state.

Response bookkeeping: logits at position t predict token t+1, so the response tokens of a sample are
predicted by the positions just before them. `tether.train.rank.batching.MicroBatchTensors.response_index`
lists those positions; `response_logits` picks them out first so only response rows are computed on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def response_logits(logits: torch.Tensor, response_index: torch.Tensor) -> torch.Tensor:
    """Rows of `logits` ([b, s, v] from the model) that predict response tokens: [N, v], sample order."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, vocab]; got shape {tuple(logits.shape)}")
    return logits.reshape(-1, logits.shape[-1]).index_select(0, response_index)


def _tp_size(tp_group: dist.ProcessGroup | None) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, tp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """log softmax(logits)[target] per row. `logits` [N, v_local] float; `targets` [N] global ids.

    With a TP group of size > 1, Megatron's parallel state must be initialised and its TP group must be
    `tp_group` (Megatron's function all-reduces over its own TP group).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not line up")
    logits = logits.float()
    if _tp_size(tp_group) == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    from tether.train.model.megatron_cpu import quiet_megatron_imports

    with quiet_megatron_imports():
        from megatron.core import parallel_state, tensor_parallel

    if (
        not parallel_state.model_parallel_is_initialized()
        or parallel_state.get_tensor_model_parallel_group() is not (tp_group)
    ):
        raise RuntimeError(
            "TP log-probs need Megatron's parallel state, with tp_group as its tensor-parallel group"
        )
    # Megatron's function writes into its input (it subtracts the max in place): always give it a copy,
    # or the caller's logits (and the entropy computed from them) are silently wrong.
    return -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), targets.long())


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log Z - sum_i p_i z_i over the full vocabulary, from each rank's slice of z.

    dH/dz_i = -p_i (z_i - sum_j p_j z_j): local given the all-reduced sum, so backward needs no
    communication (the output layer's own backward reduces across TP).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        z_max = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - z_max
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, group=group)
        probs = exp / sum_exp
        mean_z = (probs * shifted).sum(dim=-1, keepdim=True)
        dist.all_reduce(mean_z, group=group)
        ctx.save_for_backward(probs, shifted, mean_z)
        return (sum_exp.log() - mean_z).squeeze(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs, shifted, mean_z = ctx.saved_tensors
        return -probs * (shifted - mean_z) * grad.unsqueeze(-1), None


def token_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) per row, [N], over the whole (possibly TP-sharded) vocabulary."""
    logits = logits.float()
    if _tp_size(tp_group) == 1:
        logp = torch.log_softmax(logits, dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)
    assert tp_group is not None
    result: torch.Tensor = _VocabParallelEntropy.apply(logits, tp_group)  # type: ignore[no-untyped-call]
    return result


def row_chunks(num_rows: int, chunk_size: int) -> list[slice]:
    """The row ranges a log-prob pass computes at a time: all rows when chunk_size <= 0 (slime's -1),
    else ceil(num_rows / chunk_size) near-equal ranges of at most chunk_size rows (slime's split)."""
    if chunk_size <= 0 or num_rows <= chunk_size:
        return [slice(0, num_rows)]
    count = -(-num_rows // chunk_size)
    step = -(-num_rows // count)  # torch.chunk's sizes: equal, the last one shorter
    return [slice(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


def log_probs_and_entropy(
    logits: torch.Tensor,
    response_index: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_size: int = -1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-response-token log-probs and entropy from the model's logits [b, s, v_local].

    `temperature` divides the logits first, matching the engine's sampling distribution
    (--rollout-temperature), as slime does. `chunk_size` (--log-probs-chunk-size): compute over at
    most that many response tokens at a time, so the softmax-sized intermediates are [chunk, v]
    instead of [N, v]; the results are the same.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    rows = response_logits(logits, response_index).float()
    if temperature != 1.0:
        rows = rows / temperature
    log_probs: list[torch.Tensor] = []
    entropy: list[torch.Tensor] = []
    for part in row_chunks(rows.shape[0], chunk_size):
        log_probs.append(token_log_probs(rows[part], targets[part], tp_group))
        if with_entropy:
            entropy.append(token_entropy(rows[part], tp_group))
    lp = log_probs[0] if len(log_probs) == 1 else torch.cat(log_probs)
    if not with_entropy:
        return lp, None
    return lp, entropy[0] if len(entropy) == 1 else torch.cat(entropy)
