"""MoE routing replay: the trainer's routers pick the experts recorded earlier instead of their own top-k.

slime's two modes (`--use-routing-replay`, `--use-rollout-routing-replay`):

- R2: the actor's log-prob forward of a step (the "old" policy) records each router's top-k
  expert indices per micro-batch; the training forward of the same step, and any activation
  recompute in its backward, replays them.
- R3: the indices the rollout engine routed each token to (SGLang's `return_routed_experts`)
  are replayed in every actor forward of the step: the log-prob forward and the training one.

Replay changes only *which* experts a token goes to: the router still computes its logits and
scores from its own weights and the combine weights are gathered from those scores at the
replayed indices, so the router weights get gradients and the aux loss sees the router's own
scores (Megatron computes those from the logits separately).

Mechanism: megatron-core's `TopKRouter.routing` passes the router instance's `router_replay`
attribute to `topk_routing_with_score_function`, which calls its `get_replay_topk(scores, topk,
num_groups, group_topk, default_compute_topk)` in place of the top-k. `RoutingReplay.install`
sets that attribute on each router of the actor with a `RouterReplay` of ours (one per router:
nothing global, the class is untouched) and `uninstall` puts back what was there. The reference
model's routers are never hooked: they route on their own, as in slime.

Order: every pipeline stage runs every micro-batch's forward in plan order, so a router's k-th
forward call of a pass belongs to micro-batch k. Calls made inside the schedule's forward step
(`RoutingReplay.forward`) are forwards; calls outside it are activation recomputes during the
backward pass, which take the entries again in their own order. Each pass checks that every
entry was consumed exactly once (a recompute consumes each entry once or, for a router whose
layer is not recomputed, never).

Token order: a micro-batch is padded [b, s]; Megatron's router sees hidden states [s, b, h]
flattened s-major (token t of row i is entry t * b + i); under sequence parallelism each TP rank
routes its own s/TP slice of the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tether.runtime.errors import ConfigError
from tether.train.rank.batching import UNROUTED

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# UNROUTED marks a token no engine routed (each sample's last token, padding): any valid experts
# do for it, since its output reaches no loss position (causal attention, padding masked).


class RoutingReplayError(RuntimeError):
    """Recorded or given expert indices do not line up with the forward passes that use them."""


class RouterReplay:
    """The replay state of one MoE router: entries (top-k indices per micro-batch) and counters.

    Megatron calls `get_replay_topk` in place of its top-k; what it does depends on the mode the
    owning `RoutingReplay` set: None routes normally, "record" routes normally and keeps the
    indices, "replay" returns the next entry's indices.
    """

    def __init__(self, owner: RoutingReplay, name: str, layer: int, topk: int, num_experts: int) -> None:
        self.owner = owner
        self.name = name
        self.layer = layer  # 0-based global layer index (the HF layer the engine reports)
        self.topk = topk
        self.num_experts = num_experts
        self.entries: list[torch.Tensor] = []
        self.forward_used = 0
        self.recompute_used = 0

    def __repr__(self) -> str:
        return f"router {self.name} (layer {self.layer})"

    def reset(self) -> None:
        self.entries = []
        self.forward_used = 0
        self.recompute_used = 0

    # Megatron's hook: the signature of megatron.core.transformer.moe.router_replay.RouterReplay's.
    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mode = self.owner.mode
        if mode is None or mode == "record":
            assert default_compute_topk is not None
            probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if mode == "record":
                if not self.owner.in_forward:
                    raise RoutingReplayError(f"{self}: a recompute ran while routing was being recorded")
                self.entries.append(_keep(indices))
            return probs, indices
        if self.owner.in_forward:
            k, self.forward_used = self.forward_used, self.forward_used + 1
            kind = "forward"
        else:
            k, self.recompute_used = self.recompute_used, self.recompute_used + 1
            kind = "recompute"
        if k >= len(self.entries):
            raise RoutingReplayError(
                f"{self}: {kind} call {k + 1} of this pass has no entry to replay "
                f"({len(self.entries)} recorded or given, one per micro-batch)"
            )
        indices = self.entries[k].to(scores.device, torch.int64, non_blocking=True)
        if indices.shape != (scores.shape[0], topk):
            raise RoutingReplayError(
                f"{self}: micro-batch {k} replays indices of shape {tuple(indices.shape)} "
                f"but routes {scores.shape[0]} tokens to top-{topk}"
            )
        return scores.gather(1, indices), indices


def _keep(indices: torch.Tensor) -> torch.Tensor:
    """A recorded entry, off the device (a step's routing for every layer can be large)."""
    if indices.is_cuda:
        # Pinned, copied on the stream: the replay's later host-to-device copy is ordered after it.
        out = torch.empty(indices.shape, dtype=torch.int32, pin_memory=True)
        return out.copy_(indices.detach().to(torch.int32), non_blocking=True)
    return indices.detach().to(torch.int32, copy=True)


def _routers(chunks: Sequence[Any]) -> list[tuple[str, Any]]:
    """(qualified name, module) of every TopKRouter in the chunks, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for c, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                found.append((f"chunk{c}.{name}" if len(chunks) > 1 else name, module))
    return found


class RoutingReplay:
    """Replay hooks on every MoE router of one model (this rank's chunks), and the passes over them.

    `from_rollout`: R3, the entries come from the rollout's routed experts; otherwise R2, they
    are recorded by the actor's log-prob forward.
    """

    def __init__(self, from_rollout: bool) -> None:
        self.from_rollout = from_rollout
        self.mode: str | None = None  # None | "record" | "replay"
        self.in_forward = False
        self.routers: list[RouterReplay] = []
        self._installed: list[tuple[Any, Any]] = []  # (router module, what its attribute held)
        self.sequence_parallel = False
        self.tp_rank = 0
        self.tp_size = 1
        self.num_layers = 0  # the whole model's, every PP stage's layers (the engine reports all)

    @classmethod
    def install(cls, chunks: Sequence[Any], *, from_rollout: bool, flag: str) -> RoutingReplay:
        """Hook every TopKRouter of `chunks`; `flag` names the option that asked (for errors)."""
        found = _routers(chunks)
        if not found:
            # A PP stage may hold only dense layers while another holds the routers; each stage
            # replays its own. A model with no router at all is refused at parse time.
            return cls(from_rollout)
        replay = cls(from_rollout)
        for name, module in found:
            cfg = module.config
            if cfg.moe_router_fusion:
                raise ConfigError(
                    "--moe-router-fusion", True, f"{flag}: the fused router kernel takes no replayed experts"
                )
            if module.routing_type == "sinkhorn":
                raise ConfigError(
                    "--moe-router-load-balancing-type",
                    "sinkhorn",
                    f"{flag}: sinkhorn routing has no top-k step to replay",
                )
            if module.router_replay is not None:
                raise ConfigError(
                    "moe_enable_routing_replay", True, f"{flag}: Megatron's own router replay is on already"
                )
            if int(getattr(module, "layer_number", 0) or 0) < 1:
                raise RoutingReplayError(f"router {name} has no layer number (not built inside a layer)")
        for name, module in found:  # every router checked first: a refusal leaves none hooked
            layer = int(module.layer_number) - 1
            entry = RouterReplay(replay, name, layer, int(module.topk), int(module.config.num_moe_experts))
            replay._installed.append((module, module.router_replay))
            module.router_replay = entry
            replay.routers.append(entry)
        first = found[0][1].config
        replay.num_layers = int(first.num_layers)
        replay.sequence_parallel = bool(first.sequence_parallel)
        replay.tp_size = int(first.tensor_model_parallel_size)
        if replay.tp_size > 1:
            from megatron.core import parallel_state as ps

            replay.tp_rank = ps.get_tensor_model_parallel_rank()
        return replay

    def uninstall(self) -> None:
        """Give every router back what it had (Megatron's None): nothing of ours stays."""
        for module, previous in self._installed:
            module.router_replay = previous
        self._installed = []
        self.routers = []
        self.mode = None

    def clear(self) -> None:
        for r in self.routers:
            r.reset()
        self.mode = None

    @property
    def has_record(self) -> bool:
        return any(r.entries for r in self.routers)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the model call of the schedule's forward step: router calls inside are forwards."""
        self.in_forward = True
        try:
            yield
        finally:
            self.in_forward = False

    # ----- passes -----
    @contextlib.contextmanager
    def recording(self, num_micro_batches: int) -> Iterator[None]:
        """R2's log-prob pass: record every router's indices, one entry per micro-batch."""
        if self.has_record:
            raise RoutingReplayError(
                "--use-routing-replay: a new recording began while the previous one was never replayed "
                f"({self._counts()})"
            )
        self.clear()
        self.mode = "record"
        try:
            yield
        except BaseException:
            self.clear()
            raise
        finally:
            self.mode = None
        for r in self.routers:
            held = len(r.entries)
            if held != num_micro_batches:
                counts = self._counts()
                self.clear()
                raise RoutingReplayError(
                    f"{r}: recorded {held} forwards for {num_micro_batches} micro-batches ({counts})"
                )

    @contextlib.contextmanager
    def replaying(self, num_micro_batches: int) -> Iterator[None]:
        """Replay the entries (recorded, or given with `load`) over `num_micro_batches` forwards;
        afterwards every entry must have been consumed exactly once in forward (and in recompute
        once or, for a router whose layer is not recomputed, never), and the entries are spent."""
        for r in self.routers:
            held = len(r.entries)
            if held != num_micro_batches:
                counts = self._counts()
                self.clear()
                what = (
                    "given" if self.from_rollout else "recorded (by the actor's log-prob pass of this step)"
                )
                raise RoutingReplayError(
                    f"{r}: {held} entries {what} for a pass of {num_micro_batches} micro-batches ({counts})"
                )
            r.forward_used = r.recompute_used = 0
        self.mode = "replay"
        try:
            yield
            self._check_consumed()
        except BaseException:
            self.clear()
            raise
        finally:
            self.mode = None
        self.clear()

    def _check_consumed(self) -> None:
        for r in self.routers:
            n = len(r.entries)
            if r.forward_used != n or r.recompute_used not in (0, n):
                raise RoutingReplayError(
                    f"routing replay was not consumed exactly once: {r} had {n} entries, replayed "
                    f"{r.forward_used} in forward and {r.recompute_used} in recompute ({self._counts()})"
                )

    def _counts(self) -> str:
        parts = [f"{r.name}: {len(r.entries)}/{r.forward_used}/{r.recompute_used}" for r in self.routers[:16]]
        more = f", ... {len(self.routers) - 16} more" if len(self.routers) > 16 else ""
        return "entries/forward/recompute " + "; ".join(parts) + more

    def load(self, micro_batches: Sequence[torch.Tensor | None]) -> None:
        """R3: give each router its entries from the micro-batches' routed experts.

        Each item is one micro-batch's int32 [s, b, L, k] (L: every layer of the model, in the
        engine's numbering; UNROUTED where no engine routed the token), in plan order.
        """
        self.clear()
        for k, table in enumerate(micro_batches):
            if table is None:
                raise RoutingReplayError(
                    f"--use-rollout-routing-replay: micro-batch {k} carries no routed experts "
                    "(the rollout did not return them)"
                )
            local = self._local(table)
            s, b, layers, topk = local.shape
            if self.routers and layers != self.num_layers:
                raise RoutingReplayError(
                    f"--use-rollout-routing-replay: micro-batch {k}'s routed experts cover {layers} layers; "
                    f"the model has {self.num_layers}"
                )
            for r in self.routers:
                if r.layer >= layers:
                    raise RoutingReplayError(
                        f"{r}: the routed experts cover {layers} layers; this model has layer {r.layer}"
                    )
                if topk != r.topk:
                    raise RoutingReplayError(
                        f"{r}: the routed experts hold top-{topk} per token; the router picks top-{r.topk}"
                    )
                entry = local[:, :, r.layer, :].reshape(s * b, topk)
                filler = torch.arange(topk, dtype=entry.dtype, device=entry.device)
                entry = torch.where(entry == UNROUTED, filler, entry)
                bad = (entry < 0) | (entry >= r.num_experts)
                if bool(bad.any()):
                    value = int(entry[bad][0])
                    raise RoutingReplayError(
                        f"{r}: micro-batch {k} routes a token to expert {value}; the model has "
                        f"{r.num_experts} experts"
                    )
                r.entries.append(entry.contiguous())

    def _local(self, table: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of the sequence under sequence parallelism, else all of it."""
        if not self.sequence_parallel or self.tp_size == 1:
            return table
        s = table.shape[0]
        if s % self.tp_size:
            raise RoutingReplayError(
                f"a micro-batch of {s} positions does not split over {self.tp_size} TP ranks"
            )
        part = s // self.tp_size
        return table[self.tp_rank * part : (self.tp_rank + 1) * part]


__all__ = ["UNROUTED", "RouterReplay", "RoutingReplay", "RoutingReplayError"]
