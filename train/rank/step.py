"""One optimizer step and forward-only passes through Megatron's pipeline schedule.

`run_schedule` drives `get_forward_backward_func()` over a list of micro-batches with a loss
callback that sees this rank's vocab-parallel logits shard. Loss scaling follows the
contract of the RL math (tether.train.algorithms.losses): a micro-batch's loss is already a *sum* of
token losses times per-token weights whose total over the step (all micro-batches, all DP
ranks) is the step mean; `losses.megatron_loss_scale` undoes Megatron's division by the
micro-batch count and DDP's DP average, so the gradient is exactly that of the summed loss.

`train_step` and `compute_log_probs` are what the worker runs: every rank of the job calls
them with its DP shard (ranks of one DP group get the same shard) and the same micro-batch
plan length, and every rank returns the same result (broadcast from the last PP stage).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tether.runtime.errors import ConfigError
from tether.train.algorithms import loss_hooks, losses
from tether.train.algorithms.logprobs import log_probs_and_entropy
from tether.train.config import AlgorithmConfig
from tether.train.model import megatron_args, mtp
from tether.train.model.families.dsa import wants_mask
from tether.train.model.megatron_cpu import quiet_megatron_imports
from tether.train.parallel import context as context_parallel
from tether.train.rank.batching import MicroBatchTensors, TrainBatch, micro_batch_tensors

if TYPE_CHECKING:
    from tether.train.parallel.routing_replay import RoutingReplay


class ForwardInput(Protocol):
    """What a micro-batch must carry for the GPT forward (and optionally `attention_mask`)."""

    @property
    def tokens(self) -> torch.Tensor: ...

    @property
    def position_ids(self) -> torch.Tensor: ...


# (logits shard [b, s, V/TP], micro-batch) → (loss to backprop, metrics to report)
LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class MicroBatch:
    """Bare forward input (no loss columns): `tokens`/`position_ids` [b, s], causal attention."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None


def _forward_step(
    loss_fn: LossFn,
    scale: float,
    device: torch.device,
    *,
    per_token: bool,
    routing: RoutingReplay | None = None,
    train: bool = False,
) -> Callable[[Any, Any], Any]:
    """Megatron's forward-step callback. `per_token` (--calculate-per-token-loss): the loss is a plain
    sum over the micro-batch's trainable tokens, returned with their count, and Megatron divides
    the gradients by the count over the whole step (all micro-batches and DP ranks). `routing`:
    MoE routing replay, told which router calls are forwards (the rest are recomputes). `train`: a
    training pass, where a model training MTP layers gets their labels (tether.train.model.mtp)."""

    cp = context_parallel.current()

    def forward_step(data_iterator: Any, model: Any) -> Any:
        # Under context parallelism the model and the loss see this CP rank's share of the sequence.
        whole = next(data_iterator)
        mb = context_parallel.localize(whole, cp)
        mask = getattr(mb, "attention_mask", None)
        if mask is None and wants_mask(model):
            s = int(mb.tokens.shape[1])
            mask = context_parallel.local_causal_mask(torch.arange(s), s)
        extra: dict[str, Any] = {}
        if train and mtp.training_model(model) is not None:
            # Labels and mask from the whole sequence, then this rank's positions (Megatron's MTP
            # rolls them across the CP ranks itself).
            extra = mtp.forward_inputs(whole.tokens.to(device), whole.response_index, whole.loss_mask)
            extra = {k: context_parallel.slice_sequence(v, cp) for k, v in extra.items()}
        with routing.forward() if routing is not None else contextlib.nullcontext():
            logits = model(
                mb.tokens.to(device),
                mb.position_ids.to(device),
                None if mask is None else mask.to(device),
                **extra,
            )

        def loss_func(output: torch.Tensor) -> tuple[Any, ...]:
            loss, metrics = loss_fn(output, mb)
            if per_token:
                # Megatron divides the gradients by the count summed over DP x CP: every CP rank's
                # loss covers the whole micro-batch, so one of them counts its tokens.
                count = mb.loss_mask.sum().to(torch.int)
                return loss, count if cp.rank == 0 else torch.zeros_like(count), metrics
            return loss * scale, metrics

        return logits, loss_func

    return forward_step


def run_schedule(
    chunks: list[Any],
    config: Any,
    microbatches: Sequence[ForwardInput],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    routing: RoutingReplay | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run every micro-batch through the pipeline; metrics per micro-batch on the last stage.

    All ranks of the job must call this with the same number of micro-batches (ranks of one DP
    group get the same ones; shapes may vary between micro-batches). `routing`: the model's MoE
    routing replay, already in the pass (record or replay) it is to run.
    """
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

    from tether.train.parallel.topology import device

    if not microbatches:
        return []
    n = len(microbatches)
    scale = losses.megatron_loss_scale(n, ps.get_data_parallel_world_size())
    # Micro-batches differ in shape; PP must then exchange shapes before each activation.
    config.variable_seq_lengths = ps.get_pipeline_model_parallel_world_size() > 1
    seq_length = max(int(mb.tokens.shape[1]) for mb in microbatches)
    micro_batch_size = max(int(mb.tokens.shape[0]) for mb in microbatches)
    per_token = bool(config.calculate_per_token_loss) and not forward_only
    fb = get_forward_backward_func()
    out = fb(
        forward_step_func=_forward_step(
            loss_fn, scale, device(), per_token=per_token, routing=routing, train=not forward_only
        ),
        data_iterator=iter(list(microbatches)),
        model=chunks,
        num_microbatches=n,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    return list(out) if out else []


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits from a TP shard (tests and debugging; training never gathers)."""
    with quiet_megatron_imports():
        from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def forward_logits(
    chunks: list[Any], config: Any, microbatches: Sequence[MicroBatch], vocab_size: int
) -> list[torch.Tensor]:
    """Full-vocab logits per micro-batch on the last PP stage (empty list elsewhere)."""

    def keep(logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        full = gather_vocab(logits.detach())[..., :vocab_size]
        return logits.new_zeros(()), {"logits": context_parallel.gather_sequence(full, 1)}

    with torch.no_grad():
        out = run_schedule(chunks, config, microbatches, keep, forward_only=True)
    return [m["logits"] for m in out]


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exclude the rows Megatron pads the vocabulary with (to a multiple of TP) from the softmax.

    A very negative finite value (not -inf) keeps entropy's p * log p at 0 instead of NaN.
    """
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    valid = vocab_size - start
    if valid >= local:
        return logits
    keep = torch.arange(local, device=logits.device) < valid
    return logits.masked_fill(~keep, -1e30)


@dataclass(frozen=True)
class StepOptions:
    """Per-step settings the head passes (from the rollout and algorithm slices)."""

    temperature: float = 1.0
    with_entropy: bool = True
    chunk_size: int = -1  # --log-probs-chunk-size: response tokens per log-prob/entropy computation


def _load_custom_loss(path: str | None) -> Callable[..., losses.LossOutput]:
    if not path:
        raise ConfigError("--custom-loss-function-path", path, "required with --loss-type custom_loss")
    module, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError("--custom-loss-function-path", path, f"cannot import: {e}") from e
    if not callable(fn):
        raise ConfigError("--custom-loss-function-path", path, "is not callable")
    return fn  # type: ignore[no-any-return]


def micro_batch_total_lengths(mb: MicroBatchTensors) -> list[int]:
    """Each sample's prompt + response length: as built, or from the padded layout (the last query
    row of the attention mask is blocked exactly at the padding keys)."""
    if mb.total_lengths is not None:
        return list(mb.total_lengths)
    blocked = mb.attention_mask[:, 0, -1, :]
    return [int(n) for n in (blocked.shape[-1] - blocked.sum(dim=-1)).tolist()]


def rl_loss_fn(
    algo: AlgorithmConfig,
    vocab_size: int,
    opts: StepOptions,
    *,
    unit_token_weights: bool = False,
    hooks: losses.LossHooks | None = None,
) -> LossFn:
    """The loss for a micro-batch: policy (PPO/GSPO/CISPO + KL/entropy/TIS), SFT, or a custom function.

    A custom function takes `(algo, **columns)` like `losses.policy_loss` and returns a LossOutput.
    `unit_token_weights` (--calculate-per-token-loss): every trainable token weighs 1 and Megatron
    divides by the step's token count, instead of the step weights the batch carries. `hooks`:
    slime's custom TIS function and pg-loss reducer (tether.train.algorithms.loss_hooks), for the policy loss.
    """
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    custom = _load_custom_loss(algo.custom_loss_function_path) if algo.loss_type == "custom_loss" else None

    def loss_fn(logits: torch.Tensor, mb: MicroBatchTensors) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = mask_padded_vocab(logits, vocab_size)
        tp_group = (
            ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        )
        log_probs, entropy = log_probs_and_entropy(
            logits,
            mb.response_index.to(logits.device),
            mb.targets.to(logits.device),
            tp_group=tp_group,
            temperature=opts.temperature,
            with_entropy=opts.with_entropy,
            chunk_size=algo.log_probs_chunk_size,
        )
        log_probs = context_parallel.full_response(log_probs, mb)
        if entropy is not None:
            entropy = context_parallel.full_response(entropy, mb)
        mbd = mb.to(logits.device)
        if unit_token_weights:
            mbd = dataclasses.replace(mbd, token_weight=mbd.loss_mask.float())
        if algo.loss_type == "sft_loss":
            out = losses.sft_loss(log_probs=log_probs, token_weight=mbd.token_weight)
            if entropy is not None:
                out.metrics["entropy"] = losses.weighted_sum(entropy, mbd.token_weight).detach()
        else:
            if mbd.advantages is None:
                raise ValueError("the batch has no advantages; compute them before a policy-loss step")
            columns: dict[str, Any] = {
                "log_probs": log_probs,
                "token_weight": mbd.token_weight,
                "loss_mask": mbd.loss_mask,
                "response_lengths": mbd.response_lengths,
                "advantages": mbd.advantages,
                "old_log_probs": mbd.old_log_probs,
                "rollout_log_probs": mbd.rollout_log_probs,
                "ref_log_probs": mbd.ref_log_probs,
                "entropy": entropy,
            }
            if custom is not None:
                out = custom(algo, **columns)
            else:
                out = losses.policy_loss(
                    algo, **columns, hooks=hooks, total_lengths=micro_batch_total_lengths(mbd)
                )
        out.metrics["trainable_tokens"] = mbd.loss_mask.sum().detach()
        return out.loss, out.metrics

    return recomputed(loss_fn) if algo.recompute_loss_function else loss_fn


def recomputed(loss_fn: LossFn) -> LossFn:
    """--recompute-loss-function: the loss keeps only its inputs (the logits) for the backward pass
    and runs again there, as slime wraps it, instead of holding its vocabulary-wide intermediates
    (log-softmax, entropy) from forward to backward. Non-reentrant, as slime's: the metrics and
    the micro-batch pass through, and the recomputation reruns the loss's TP/CP collectives on
    every rank alike."""

    def checkpointed(logits: torch.Tensor, mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return checkpoint(loss_fn, logits, mb, use_reentrant=False)  # type: ignore[no-any-return]

    return checkpointed


def _broadcast_from_last_stage(obj: Any) -> Any:
    """Send a picklable object from the last PP stage to every stage of this pipeline."""
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    box = [obj]
    dist.broadcast_object_list(box, src=ranks[-1], group=group)
    return box[0]


def _dp_sum(t: torch.Tensor) -> torch.Tensor:
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(t, group=ps.get_data_parallel_group())
    return t


def build_micro_batches(
    shard: TrainBatch,
    plan: Sequence[Sequence[int]],
    *,
    config: Any = None,
    max_length: int | None = None,
) -> list[MicroBatchTensors]:
    """This rank's micro-batch tensors from its DP shard and its row of the plan.

    `config` (the model's TransformerConfig): each micro-batch is padded to a multiple of TP x
    --data-pad-size-multiplier (per CP rank; `megatron_args.micro_batch_multiple`). `max_length` (--seq-length, default the model's max positions): a longer
    sample is refused.
    """
    if max_length is not None and shard.num_samples:
        longest = int(shard.total_lengths.max())
        if longest > max_length:
            raise ConfigError(
                "--seq-length",
                max_length,
                f"a sample of {longest} tokens (prompt + response) is longer than the trainer accepts "
                "(--seq-length, default: max_position_embeddings of the model)",
            )
    multiple = 1 if config is None else megatron_args.micro_batch_multiple(config)
    shapes = [(0, 0)] * len(plan)
    if config is not None and _gathers_equal_token_counts(config):
        shapes = _common_shapes(shard, plan)
    return [
        micro_batch_tensors(shard, list(idx), pad_to_multiple_of=multiple, min_shape=shape)
        for idx, shape in zip(plan, shapes, strict=True)
    ]


def _gathers_equal_token_counts(config: Any) -> bool:
    """Megatron's allgather token dispatcher at EP > 1 all-gathers every expert-parallel rank's tokens
    into one buffer, which needs the same token count on each; those ranks hold different DP shards."""
    return (
        bool(getattr(config, "num_moe_experts", None))
        and int(getattr(config, "expert_model_parallel_size", 1) or 1) > 1
        and getattr(config, "moe_token_dispatcher_type", "allgather") == "allgather"
    )


def _common_shapes(shard: TrainBatch, plan: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Each micro-batch's (rows, positions): the largest over the data- and context-parallel ranks
    (every rank runs the same number of micro-batches), to pad to."""
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    lengths = shard.total_lengths
    mine = torch.tensor([[len(idx), int(lengths[list(idx)].max())] for idx in plan], dtype=torch.int64)
    from tether.train.parallel.topology import collective_device

    shapes = mine.to(collective_device())
    dist.all_reduce(
        shapes, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True)
    )
    return [(int(b), int(s)) for b, s in shapes.cpu().tolist()]


def _routing_pass(
    routing: RoutingReplay | None, mbs: Sequence[MicroBatchTensors], *, log_probs: bool
) -> contextlib.AbstractContextManager[None]:
    """The routing-replay pass of a forward over `mbs`: R3 replays the rollout's routed experts in
    every actor pass; R2 records in the actor's log-prob pass and replays that in training."""
    if routing is None:
        return contextlib.nullcontext()
    if routing.from_rollout:
        routing.load([context_parallel.localize(mb).routed_experts for mb in mbs])  # this CP rank's tokens
        return routing.replaying(len(mbs))
    return routing.recording(len(mbs)) if log_probs else routing.replaying(len(mbs))


def _max_length(chunks: list[Any]) -> int | None:
    from tether.train.model.build import unwrap

    value = getattr(unwrap(chunks[0]), "max_sequence_length", None) if chunks else None
    return int(value) if value else None


def _step_num_samples(shard: TrainBatch) -> int:
    """The samples of the whole step (all DP shards; filler copies carry no weight and do not count):
    slime's step_global_batch_size, the divisor of a custom-reduced pg loss."""
    count = torch.tensor([float((shard.loss_weights > 0).sum())])
    return int(_dp_sum(count).item())


def optimizer_step(actor: Any) -> tuple[bool, float | None]:
    """The optimizer step: (applied, grad norm).

    With Megatron's NaN check on (the default) a NaN/Inf gradient fails the step in the DDP
    gradient sync. Under --no-check-for-nan-in-loss-and-grad, as slime does, the gradient norm is
    computed first and a step whose norm is not finite is skipped (the gradients are dropped).
    """
    ddp_config = getattr(actor.chunks[0], "ddp_config", None)
    if not getattr(ddp_config, "check_for_nan_in_grad", True):
        if actor.optimizer.prepare_grads():  # found inf (mixed precision's loss scaler)
            return False, None
        norm = actor.optimizer.get_grad_norm()
        if not math.isfinite(float(norm)):
            return False, float(norm)
    ok, grad_norm, _ = actor.optimizer.step()
    return bool(ok), None if grad_norm is None else float(grad_norm)


def train_step(
    actor: Any,
    shard: TrainBatch,
    plan: Sequence[Sequence[int]],
    algo: AlgorithmConfig,
    opts: StepOptions = StepOptions(),
    routing: RoutingReplay | None = None,
    before: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Forward/backward over the micro-batches, then one optimizer step; step metrics on every rank.

    Metrics: each loss term and statistic from the loss (step means), grad_norm, lr, whether the
    step was applied, trainable tokens, tokens/s over the whole job. `routing`: the actor's MoE
    routing replay (--use-routing-replay / --use-rollout-routing-replay), replayed in this step.
    `before`: called once the gradients are zeroed (--custom-megatron-before-train-step-hook-path).
    """
    start = time.perf_counter()
    for chunk in actor.chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    actor.optimizer.zero_grad()
    if before is not None:
        before()
    mbs = build_micro_batches(shard, plan, config=actor.config, max_length=_max_length(actor.chunks))
    per_token = bool(actor.config.calculate_per_token_loss)
    hooks = None
    if algo.loss_type == "policy_loss":
        hooks = loss_hooks.load_loss_hooks(
            algo,
            calculate_per_token_loss=per_token,
            step_num_samples=_step_num_samples(shard) if algo.custom_pg_loss_reducer_function_path else 1,
        )
    mtp_models = [m for m in (mtp.training_model(c) for c in actor.chunks) if m is not None]
    for model in mtp_models:
        mtp.reset(model)
    with _routing_pass(routing, mbs, log_probs=False):
        per_mb = run_schedule(
            actor.chunks,
            actor.config,
            mbs,
            rl_loss_fn(algo, actor.arch.vocab_size, opts, unit_token_weights=per_token, hooks=hooks),
            forward_only=False,
            routing=routing,
        )
    ok, grad_norm = optimizer_step(actor)
    lr = float(actor.optimizer.param_groups[0]["lr"])
    if ok:
        actor.scheduler.step(increment=1)
    metrics: dict[str, float] | None = None
    if per_mb:
        # Token-weighted terms are shares of step means: summing over micro-batches and DP ranks
        # gives the step value. The trainable-token count sums the same way.
        metrics = losses.sum_metrics(per_mb, all_reduce=_dp_sum)
        if per_token:
            # Unit token weights: the sums are over the step's tokens; their mean is the step value.
            denominator = max(metrics["trainable_tokens"], 1.0)
            metrics = {k: v if k == "trainable_tokens" else v / denominator for k, v in metrics.items()}
        if mtp_models:
            metrics.update(_mtp_metrics(mtp_models[0]))
    metrics = _broadcast_from_last_stage(metrics) or {}
    tokens = torch.tensor([float(sum(mb.num_tokens for mb in mbs))])
    tokens = _dp_sum(tokens)
    elapsed = time.perf_counter() - start
    metrics.update(
        grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
        lr=lr,
        step_applied=float(bool(ok)),
        tokens=float(tokens.item()),
        tokens_per_second=float(tokens.item()) / max(elapsed, 1e-9),
        step_seconds=elapsed,
    )
    return metrics


def _mtp_metrics(model: Any) -> dict[str, float]:
    """slime's MTP metrics of the step: `mtp_{k}_loss` per MTP layer (its loss averaged over the
    micro-batches and the data-parallel ranks) and `mtp_loss`, their sum. On the last stage."""
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    cp = context_parallel.current()
    values = torch.tensor(mtp.layer_losses(model, cp.group) or [0.0] * int(model.config.mtp_num_layers))
    values = _dp_sum(values) / ps.get_data_parallel_world_size()
    out = {f"mtp_{k + 1}_loss": float(v) for k, v in enumerate(values.tolist())}
    out["mtp_loss"] = float(values.sum())
    return out


def compute_log_probs(
    chunks: list[Any],
    config: Any,
    vocab_size: int,
    shard: TrainBatch,
    plan: Sequence[Sequence[int]],
    opts: StepOptions = StepOptions(),
    routing: RoutingReplay | None = None,
    before: Callable[[], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-response-token log-probs (and entropy) of this DP shard, float32, in shard order.

    Every rank of a DP group returns the same arrays (broadcast from the last PP stage).
    `routing`: the actor's MoE routing replay: R3 replays the rollout's experts, R2 records the
    routing for the training step that follows. `before`: called once the chunks are in eval mode
    (--custom-megatron-before-log-prob-hook-path).
    """
    with quiet_megatron_imports():
        from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None

    def keep(logits: torch.Tensor, mb: MicroBatchTensors) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp, ent = log_probs_and_entropy(
            mask_padded_vocab(logits, vocab_size),
            mb.response_index.to(logits.device),
            mb.targets.to(logits.device),
            tp_group=tp_group,
            temperature=opts.temperature,
            with_entropy=opts.with_entropy,
            chunk_size=opts.chunk_size,
        )
        lp = context_parallel.full_response(lp, mb)
        if ent is not None:
            ent = context_parallel.full_response(ent, mb)
        out = {"log_probs": lp.detach().float().cpu()}
        if ent is not None:
            out["entropy"] = ent.detach().float().cpu()
        return logits.new_zeros(()), out

    for chunk in chunks:
        chunk.eval()
    if before is not None:
        before()
    mbs = build_micro_batches(shard, plan, config=config, max_length=_max_length(chunks))
    with torch.no_grad(), _routing_pass(routing, mbs, log_probs=True):
        per_mb = run_schedule(chunks, config, mbs, keep, forward_only=True, routing=routing)
    result: tuple[np.ndarray, np.ndarray | None] | None = None
    if per_mb:
        # Put every micro-batch's response tokens back at their place in the shard.
        total = int(shard.response_lengths.sum())
        ro = shard.response_offsets
        lp_out = np.zeros(total, dtype=np.float32)
        ent_out = np.zeros(total, dtype=np.float32) if "entropy" in per_mb[0] else None
        for idx, m in zip(plan, per_mb, strict=True):
            pos = np.concatenate([np.arange(ro[i], ro[i + 1]) for i in idx])
            lp_out[pos] = m["log_probs"].numpy()
            if ent_out is not None:
                ent_out[pos] = m["entropy"].numpy()
        result = (lp_out, ent_out)
    result = _broadcast_from_last_stage(result)
    assert result is not None
    return result
