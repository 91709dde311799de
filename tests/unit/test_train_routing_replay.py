"""MoE routing replay on a real (tiny) Megatron MoE GPTModel, in this process (a one-rank gloo group
on an in-memory store: no process is started).

Replayed experts are checked against an independent reference: the same weights in a model whose
routers use Megatron's own RouterReplay (`moe_enable_routing_replay`) forced to the same indices.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import moe_model as mm

from tether.runtime.errors import ConfigError
from tether.train.parallel.routing_replay import RoutingReplay, RoutingReplayError

S, B = 6, 2  # sequence, batch

# Megatron warns about its own deprecations (tp_group defaults, ...) while building layers.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron.*"),
]


@pytest.fixture(scope="module")
def dist_one_rank() -> Iterator[None]:
    import torch.distributed as dist

    from tether.train.parallel import topology as parallel

    with warnings.catch_warnings():
        # torch.compile machinery imported by megatron.core warns about torch's own deprecations.
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt
        import megatron.core.models.gpt.gpt_layer_specs
        import megatron.core.transformer.moe.router_replay  # noqa: F401
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # init_distributed patches torch for Megatron on CPU (tether.train.model.megatron_cpu); other unit
    # tests share this process, so every patched attribute is put back afterwards.
    patched = _patch_points()
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel.init_distributed(1, 1, seed=3)
    try:
        yield
    finally:
        parallel.destroy()
        for owner, name, value in originals:
            setattr(owner, name, value)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _patch_points() -> list[tuple[Any, str]]:
    """Every attribute tether.train.model.megatron_cpu.apply() replaces."""
    import megatron.core.tensor_parallel.random as mrandom

    from tether.train.model import megatron_cpu

    points: list[tuple[Any, str]] = [(torch, name) for name in megatron_cpu._FACTORIES]
    cuda_names = (
        "current_device",
        "manual_seed",
        "get_rng_state",
        "set_rng_state",
        "synchronize",
        "empty_cache",
    )
    points += [(torch.cuda, name) for name in cuda_names]
    points += [(torch.cuda.random, "get_rng_state"), (torch.cuda.random, "set_rng_state")]
    points += [(torch.Tensor, name) for name in ("type", "to", "cuda", "pin_memory")]
    points += [(mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state")]
    return points


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, mm.VOCAB, (B, S), generator=g)
    positions = torch.arange(S).expand(B, S)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, positions, mask


def model(**overrides: Any) -> Any:
    return mm.moe_model(mm.moe_config(**overrides), seed=7)


def given_table(seed: int) -> torch.Tensor:
    """int32 [S, B, layers, topk]: distinct random experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(S, B, 2, mm.EXPERTS, generator=g)
    return scores.topk(mm.TOPK, dim=-1).indices.to(torch.int32)


def megatron_forced(table: torch.Tensor, *, train: bool = False) -> tuple[Any, Any]:
    """Reference: the same weights with Megatron's own router replay forced to `table`."""
    from megatron.core.transformer.moe.router_replay import RouterReplay as MegatronReplay
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    MegatronReplay.clear_global_router_replay_instances()
    ref = model(moe_enable_routing_replay=True)
    MegatronReplay.set_replay_data([table[:, :, layer].reshape(S * B, mm.TOPK).long() for layer in range(2)])
    MegatronReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    ref.train(train)
    return ref, MegatronReplay


def routing_maps(m: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """Capture each router's routing map [tokens, experts] of the next forward."""
    maps: list[torch.Tensor] = []
    handles = [
        r.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach())) for r in mm.routers(m)
    ]
    return maps, handles


def test_record_then_replay_gives_identical_logits(dist_one_rank: None) -> None:
    m = model()
    m.eval()
    replay = RoutingReplay.install([m], from_rollout=False, flag="--use-routing-replay")
    assert [(r.name, r.layer) for r in replay.routers] == [
        ("decoder.layers.0.mlp.router", 0),
        ("decoder.layers.1.mlp.router", 1),
    ]
    maps, handles = routing_maps(m)
    with torch.no_grad():
        normal = [m(*inputs(k)) for k in range(2)]
        recorded_maps = list(maps)
        with replay.recording(2):
            for k in range(2):
                with replay.forward():
                    m(*inputs(k))
        assert [len(r.entries) for r in replay.routers] == [2, 2]
        maps.clear()
        with replay.replaying(2):
            replayed = []
            for k in range(2):
                with replay.forward():
                    replayed.append(m(*inputs(k)))
        assert not replay.has_record  # consumed, then cleared
        assert all(torch.equal(a, b) for a, b in zip(replayed, normal, strict=True))
        # Flip router 0: on its own it now picks other experts; replaying the record it does not.
        mm.routers(m)[0].weight.data.mul_(-1)
        with replay.recording(1), replay.forward():
            m(*inputs(0))
        mm.routers(m)[0].weight.data.mul_(-1)
        flipped_entries = [r.entries[0].clone() for r in replay.routers]
        maps.clear()
        with replay.replaying(1), replay.forward():
            m(*inputs(0))
    for h in handles:
        h.remove()
    first = [set(torch.nonzero(row).flatten().tolist()) for row in recorded_maps[0]]
    flipped = [set(row.tolist()) for row in flipped_entries[0]]
    assert first != flipped  # the flipped router chose differently...
    assert [
        set(torch.nonzero(row).flatten().tolist()) for row in maps[0]
    ] == flipped  # ...and that was replayed
    replay.uninstall()
    assert all(r.router_replay is None for r in mm.routers(m))


def test_given_experts_are_used_and_match_megatron_forced_routing(dist_one_rank: None) -> None:
    m = model()
    m.eval()
    table = given_table(1)
    replay = RoutingReplay.install([m], from_rollout=True, flag="--use-rollout-routing-replay")
    tok, pos, mask = inputs()
    maps, handles = routing_maps(m)
    with torch.no_grad():
        normal = m(tok, pos, mask)
        maps.clear()
        replay.load([table])
        with replay.replaying(1), replay.forward():
            replayed = m(tok, pos, mask)
    for h in handles:
        h.remove()
    for layer, routing_map in enumerate(maps):
        chosen = [set(torch.nonzero(row).flatten().tolist()) for row in routing_map]
        want = [set(row.tolist()) for row in table[:, :, layer].reshape(S * B, mm.TOPK)]
        assert chosen == want, f"layer {layer}"
    assert not torch.allclose(replayed, normal)  # the given experts are not the router's own choice
    ref, megatron_replay = megatron_forced(table)
    try:
        with torch.no_grad():
            forced = ref(tok, pos, mask)
    finally:
        megatron_replay.clear_global_router_replay_instances()
    torch.testing.assert_close(replayed, forced, rtol=0, atol=1e-6)
    replay.uninstall()


def test_router_weights_get_the_gradients_of_the_forced_routing(dist_one_rank: None) -> None:
    table = given_table(2)
    tok, pos, mask = inputs()
    m = model()
    m.train()
    replay = RoutingReplay.install([m], from_rollout=True, flag="--use-rollout-routing-replay")
    replay.load([table])
    with replay.replaying(1):
        with replay.forward():
            out = m(tok, pos, mask)
        out.float().pow(2).mean().backward()
    ref, megatron_replay = megatron_forced(table, train=True)
    try:
        ref(tok, pos, mask).float().pow(2).mean().backward()
    finally:
        megatron_replay.clear_global_router_replay_instances()
    for ours, theirs in zip(mm.routers(m), mm.routers(ref), strict=True):
        assert ours.weight.grad is not None and ours.weight.grad.abs().sum() > 0
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-7)
    replay.uninstall()


def test_recompute_in_backward_replays_the_same_experts(dist_one_rank: None) -> None:
    table = given_table(3)
    tok, pos, mask = inputs()
    grads = []
    for recompute in (False, True):
        extra: dict[str, Any] = (
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
            if recompute
            else {}
        )
        m = model(**extra)
        m.train()
        replay = RoutingReplay.install([m], from_rollout=True, flag="--use-rollout-routing-replay")
        replay.load([table])
        with replay.replaying(1):
            with replay.forward():
                out = m(tok, pos, mask)
            out.float().pow(2).mean().backward()
            used = [(r.forward_used, r.recompute_used) for r in replay.routers]
        assert used == ([(1, 1), (1, 1)] if recompute else [(1, 0), (1, 0)])
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
        replay.uninstall()
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_every_entry_is_consumed_exactly_once(dist_one_rank: None) -> None:
    m = model()
    m.eval()
    replay = RoutingReplay.install([m], from_rollout=True, flag="--use-rollout-routing-replay")
    tok, pos, mask = inputs()
    replay.load([given_table(4), given_table(5)])
    with pytest.raises(
        RoutingReplayError,
        match=r"decoder.layers.0.mlp.router \(layer 0\) had 2 entries, replayed 1 in forward",
    ):
        with torch.no_grad(), replay.replaying(2), replay.forward():
            m(tok, pos, mask)  # one forward for two micro-batches
    assert not replay.has_record  # a failed pass leaves nothing behind
    replay.load([given_table(4)])
    with pytest.raises(RoutingReplayError, match="forward call 2 of this pass has no entry"):
        with torch.no_grad(), replay.replaying(1):
            for _ in range(2):
                with replay.forward():
                    m(tok, pos, mask)
    replay.load([given_table(4)])
    with pytest.raises(RoutingReplayError, match="1 entries given for a pass of 2 micro-batches"):
        with replay.replaying(2):
            pass
    replay.uninstall()
    rec = RoutingReplay.install([m], from_rollout=False, flag="--use-routing-replay")
    with pytest.raises(RoutingReplayError, match="recorded 1 forwards for 2 micro-batches"):
        with torch.no_grad(), rec.recording(2), rec.forward():
            m(tok, pos, mask)
    with torch.no_grad(), rec.recording(1), rec.forward():
        m(tok, pos, mask)
    with pytest.raises(RoutingReplayError, match="previous one was never replayed"):
        with rec.recording(1):
            pass
    rec.clear()
    with pytest.raises(RoutingReplayError, match=r"0 entries recorded \(by the actor's log-prob pass"):
        with rec.replaying(1):
            pass
    rec.uninstall()


def test_load_orders_tokens_sequence_first_and_checks_experts(dist_one_rank: None) -> None:
    m = model()
    replay = RoutingReplay.install([m], from_rollout=True, flag="--use-rollout-routing-replay")
    table = given_table(6)
    table[S - 1, 0] = -1  # an unrouted token (a sample's last): any valid experts
    replay.load([table])
    for r in replay.routers:
        entry = r.entries[0]
        for t in range(S):
            for i in range(B):
                want = [0, 1] if (t, i) == (S - 1, 0) else table[t, i, r.layer].tolist()
                assert entry[t * B + i].tolist() == want
    table[0, 1, 1, 0] = mm.EXPERTS
    with pytest.raises(
        RoutingReplayError, match=r"layer 1\): micro-batch 0 routes a token to expert 4; the model has 4"
    ):
        replay.load([table])
    with pytest.raises(RoutingReplayError, match="top-3 per token; the router picks top-2"):
        replay.load([torch.zeros(S, B, 2, 3, dtype=torch.int32)])
    with pytest.raises(RoutingReplayError, match="routed experts cover 1 layers; the model has 2"):
        replay.load([torch.zeros(S, B, 1, 2, dtype=torch.int32)])
    with pytest.raises(RoutingReplayError, match="micro-batch 0 carries no routed experts"):
        replay.load([None])
    # Sequence parallelism: TP rank 1 of 2 routes the second half of the sequence.
    replay.sequence_parallel, replay.tp_size, replay.tp_rank = True, 2, 1
    table = given_table(7)
    replay.load([table])
    half = table[S // 2 :]
    assert torch.equal(replay.routers[1].entries[0], half[:, :, 1].reshape(-1, mm.TOPK))
    with pytest.raises(RoutingReplayError, match="5 positions does not split over 2 TP ranks"):
        replay.load([table[:5]])
    replay.uninstall()


def test_install_refuses_routers_it_cannot_replay(dist_one_rank: None) -> None:
    m = model(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1, moe_aux_loss_coeff=0.0)
    with pytest.raises(
        ConfigError, match="--moe-router-load-balancing-type='sinkhorn': --use-routing-replay"
    ):
        RoutingReplay.install([m], from_rollout=False, flag="--use-routing-replay")
    assert all(r.router_replay is None for r in mm.routers(m))
    dense = mm.moe_model(mm.moe_config(num_moe_experts=None, moe_ffn_hidden_size=None), seed=1)
    assert RoutingReplay.install([dense], from_rollout=False, flag="--use-routing-replay").routers == []
