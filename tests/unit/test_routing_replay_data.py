"""MoE routing replay's data path and flags: the engine's meta_info, the Sample field, the default
rollout asking for and keeping the routed experts, the columnar batch and micro-batch layout the
trainer replays from, and the parse-time refusals."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from tether.config import resolve
from tether.rollout.config import MoeRouting, moe_routing
from tether.rollout.engine_api.client import EngineClient, EngineResponseError, GenerateResponse
from tether.rollout.sample import RoutedExperts, Sample, SampleContractError, SampleStatus, validate_sample
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig
from tether.train.rank.batching import UNROUTED, build_train_batch, micro_batch_tensors
from tether.train.rank.work import WorkOptions, rollout_steps

RUN = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]
LAYERS, TOPK = 3, 2


def experts(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((rows, LAYERS, 4)), axis=-1)[..., :TOPK].astype(np.int32)


def sample(n_tokens: int = 7, response: int = 3, *, index: int = 0, routed: Any = "auto") -> Sample:
    s = Sample(
        index=index,
        group_index=index // 2,
        rollout_id=index,
        tokens=list(range(1, n_tokens + 1)),
        response_length=response,
        loss_mask=[1] * response,
        rollout_log_probs=[-0.5] * response,
        reward=1.0,
        status=SampleStatus.COMPLETED,
    )
    if isinstance(routed, str):
        s.rollout_routed_experts = RoutedExperts.from_array(experts(n_tokens - 1, seed=index))
    elif routed is not None:
        s.rollout_routed_experts = routed
    return s


def meta(values: np.ndarray, start: int = 0, **extra: Any) -> GenerateResponse:
    doc = {
        "text": "x",
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.1, 5], [-0.2, 6]],
            "routed_experts": base64.b64encode(values.astype("<i4").tobytes()).decode(),
            "routed_experts_start_len": start,
            **extra,
        },
    }
    return msgspec.json.decode(msgspec.json.encode(doc), type=GenerateResponse)


# ----- the engine's answer -----
def test_meta_info_routed_experts_decode_as_slime_does() -> None:
    values = experts(4).reshape(-1)
    flat, start = meta(values, start=2).routed_experts() or (None, None)
    assert flat is not None and flat.dtype == np.int32 and flat.tolist() == values.tolist() and start == 2
    plain = msgspec.json.decode(b'{"output_ids": [1], "meta_info": {}}', type=GenerateResponse)
    assert plain.routed_experts() is None
    with pytest.raises(EngineResponseError, match="routed_experts is not base64"):
        meta(values, routed_experts="%%%").routed_experts()
    with pytest.raises(EngineResponseError, match="holds 3 bytes, not int32 entries"):
        meta(values, routed_experts=base64.b64encode(b"abc").decode()).routed_experts()
    with pytest.raises(EngineResponseError, match="routed_experts_start_len=-1 must be >= 0"):
        meta(values, start=-1).routed_experts()


def test_client_asks_for_routed_experts_only_when_told() -> None:
    bodies: list[dict[str, Any]] = []

    async def fake(method: str, path: str, body: Any, **kwargs: Any) -> bytes:
        bodies.append(body)
        return msgspec.json.encode({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})

    async def calls() -> None:
        client = EngineClient("http://127.0.0.1:1")
        client._request_bytes = fake  # type: ignore[method-assign]
        await client.generate([1, 2], {}, return_routed_experts=True)
        await client.generate([1, 2], {})
        await client.close()

    asyncio.run(calls())
    assert bodies[0]["return_routed_experts"] is True and "return_routed_experts" not in bodies[1]


# ----- the Sample -----
def test_sample_keeps_routed_experts_as_plain_data_and_validates_them() -> None:
    s = sample()
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Sample)  # debug dumps, RPC
    assert again.rollout_routed_experts is not None
    assert np.array_equal(again.rollout_routed_experts.array(), experts(6))
    assert validate_sample(s) == 3
    with pytest.raises(
        SampleContractError,
        match=r"sample 0: rollout_routed_experts='\[5, 3, 2\]' must have shape \[len\(tokens\)-1=6",
    ):
        validate_sample(sample(routed=RoutedExperts.from_array(experts(5))))
    negative = experts(6)
    negative[2, 1, 0] = -3
    with pytest.raises(SampleContractError, match="negative expert id"):
        validate_sample(sample(routed=RoutedExperts.from_array(negative)))
    with pytest.raises(SampleContractError, match="must be a RoutedExperts"):
        validate_sample(sample(routed=experts(6)))
    with pytest.raises(ValueError, match="integer array"):
        RoutedExperts.from_array(np.zeros((6, 3), dtype=np.int32))


def test_turns_replace_or_extend_the_routed_experts() -> None:
    s = sample(routed=None)
    first = experts(6, seed=1)
    s.update_routed_experts(first.reshape(-1), 0, LAYERS, TOPK)
    assert np.array_equal(s.rollout_routed_experts.array(), first)  # type: ignore[union-attr]
    s.tokens += [8, 9]  # a next turn, answered from token 4 on (SGLang's routed_experts_start_len)
    tail = experts(4, seed=2)
    s.update_routed_experts(tail.reshape(-1), 4, LAYERS, TOPK)
    got = s.rollout_routed_experts.array()  # type: ignore[union-attr]
    assert got.shape == (8, LAYERS, TOPK)
    assert np.array_equal(got[:4], first[:4]) and np.array_equal(got[4:], tail)
    with pytest.raises(
        SampleContractError, match=r"do not fit tokens=9 from routed_experts_start_len=0 \(8 rows\)"
    ):
        s.update_routed_experts(first.reshape(-1), 0, LAYERS, TOPK)
    fresh = sample(routed=None)
    with pytest.raises(SampleContractError, match="cannot be extended from routed_experts_start_len=2"):
        fresh.update_routed_experts(experts(4).reshape(-1), 2, LAYERS, TOPK)


# ----- the default rollout -----
class _Router:
    def __init__(self, resp: GenerateResponse) -> None:
        self.resp = resp
        self.kwargs: dict[str, Any] = {}

    async def generate(self, tokens: Any, params: Any, **kwargs: Any) -> tuple[str, GenerateResponse]:
        self.kwargs = kwargs
        return "engine", self.resp

    async def close(self) -> None:
        pass


def test_default_generate_asks_for_and_keeps_the_routed_experts(tmp_path: Path) -> None:
    asyncio.run(_default_generate(tmp_path))


async def _default_generate(tmp_path: Path) -> None:
    from tether.rollout.rollout_fn import ROLLOUT_ROUTING_KEY, RolloutContext, generate_one

    prompt = [1, 2, 3]
    routed = experts(len(prompt) + 2 - 1)  # 2 generated tokens; the last is never routed
    cfg = resolve([*RUN, "--hf-checkpoint", str(tmp_path)])
    for on, want in ((True, True), (False, False)):
        router = _Router(meta(routed.reshape(-1)))
        ctx = RolloutContext(cfg, router)  # type: ignore[arg-type]
        ctx.extensions[ROLLOUT_ROUTING_KEY] = MoeRouting(layers=LAYERS, topk=TOPK, experts=4) if on else None
        s = Sample(index=0, rollout_id=0, tokens=list(prompt))
        out = await generate_one(ctx, s, {"max_new_tokens": 4})
        assert router.kwargs["return_routed_experts"] is want
        assert out.tokens == [*prompt, 5, 6] and out.status == SampleStatus.COMPLETED
        if want:
            assert np.array_equal(out.rollout_routed_experts.array(), routed)  # type: ignore[union-attr]
        else:
            assert out.rollout_routed_experts is None
    router = _Router(
        msgspec.json.decode(
            b'{"output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.1, 5]]}}',
            type=GenerateResponse,
        )
    )
    ctx = RolloutContext(cfg, router)  # type: ignore[arg-type]
    ctx.extensions[ROLLOUT_ROUTING_KEY] = MoeRouting(layers=LAYERS, topk=TOPK, experts=4)
    with pytest.raises(EngineResponseError, match=r"returned no meta_info\.routed_experts"):
        await generate_one(ctx, Sample(index=0, rollout_id=0, tokens=list(prompt)), {})


def test_slime_api_generate_asks_for_and_keeps_them_as_slime_does(tmp_path: Path) -> None:
    from tether.rollout.rollout_fn import ROLLOUT_ROUTING_KEY, RolloutContext, using_context
    from tether.rollout.slime_api.rollout.sglang_rollout import generate
    from tether.rollout.slime_api.utils.types import Sample as SlimeSample

    prompt = [1, 2, 3]
    routed = experts(len(prompt) + 2 - 1)
    router = _Router(meta(routed.reshape(-1)))
    ctx = RolloutContext(resolve([*RUN, "--hf-checkpoint", str(tmp_path)]), router)  # type: ignore[arg-type]
    ctx.extensions[ROLLOUT_ROUTING_KEY] = MoeRouting(layers=LAYERS, topk=TOPK, experts=4)

    async def run() -> Any:
        async with ctx:
            with using_context(ctx):
                return await generate(
                    ctx.args, SlimeSample(index=0, tokens=list(prompt)), {"max_new_tokens": 4}
                )

    out = asyncio.run(run())
    assert router.kwargs["return_routed_experts"] is True
    got = out.rollout_routed_experts
    assert isinstance(got, np.ndarray) and got.dtype == np.int32 and np.array_equal(got, routed)


# ----- the trainer's batch -----
def test_batch_and_micro_batches_carry_the_routed_experts_in_router_order() -> None:
    samples = [sample(7, 3, index=0), sample(5, 2, index=1), sample(6, 2, index=2)]
    batch = build_train_batch(samples, rewards=[0.0, 1.0, 0.5])
    assert batch.routed_experts is not None and batch.routed_experts.shape == (18, LAYERS, TOPK)
    assert np.array_equal(batch.routed_experts[:6], experts(6, seed=0))
    assert (batch.routed_experts[6] == UNROUTED).all()  # sample 0's last token: never routed
    picked = batch.select([2, 0])
    assert np.array_equal(picked.routed_experts[:5], experts(5, seed=2))  # type: ignore[index]
    mb = micro_batch_tensors(batch, [1, 0])  # s = 7, b = 2
    table = mb.routed_experts
    assert table is not None and tuple(table.shape) == (7, 2, LAYERS, TOPK)  # sequence first
    assert np.array_equal(table[:4, 0].numpy(), experts(4, seed=1))
    assert (table[4:, 0] == UNROUTED).all()  # sample 1's last token and padding
    assert np.array_equal(table[:6, 1].numpy(), experts(6, seed=0)) and (table[6, 1] == UNROUTED).all()
    with pytest.raises(SampleContractError, match=r"missing on samples \[1\] but set on others"):
        build_train_batch([samples[0], sample(5, 2, index=1, routed=None)], rewards=[0.0, 1.0])
    other = RoutedExperts.from_array(np.zeros((4, LAYERS + 1, TOPK), dtype=np.int32))
    with pytest.raises(
        SampleContractError,
        match=r"sample 1: rollout_routed_experts='\[4, 4, 2\]' must have shape \[len\(tokens\)-1=4, 3, 2\]",
    ):
        build_train_batch([samples[0], sample(5, 2, index=1, routed=other)], rewards=[0.0, 1.0])
    assert build_train_batch([sample(routed=None)], rewards=[0.0]).routed_experts is None


def test_routing_replay_decides_which_log_probs_a_step_needs() -> None:
    groups = [[sample(7, 3, index=0), sample(7, 2, index=1)]]
    opts = WorkOptions(global_batch_size=2)

    def models(**flags: Any) -> tuple[str, ...]:
        return rollout_steps(groups, AlgorithmConfig(**flags), opts, dp_size=1)[0].log_prob_models

    assert models() == ()  # one on-policy step: the training forward is the old policy
    assert models(use_routing_replay=True) == ("actor",)  # R2 records in the actor's log-prob pass
    assert models(use_routing_replay=True, loss_type="sft_loss") == ("actor",)
    assert models(use_rollout_routing_replay=True) == ()  # R3 replays the engine's experts instead
    no_experts = [[sample(7, 3, index=0, routed=None), sample(7, 2, index=1, routed=None)]]
    with pytest.raises(
        ConfigError, match="--use-rollout-routing-replay=True: the rollout's samples carry no"
    ):
        rollout_steps(no_experts, AlgorithmConfig(use_rollout_routing_replay=True), opts, dp_size=1)
    step = rollout_steps(groups, AlgorithmConfig(use_rollout_routing_replay=True), opts, dp_size=1)[0]
    (request,) = step.train_requests(0)
    assert request.shard.routed_experts is not None and request.shard.routed_experts.shape == (
        14,
        LAYERS,
        TOPK,
    )


# ----- flags -----
@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", TinyModelSpec(arch="qwen3_moe"))


def test_flags_mean_what_slime_means_and_dense_models_are_refused(tiny_model: Path, moe_dir: Path) -> None:
    cfg = resolve([*RUN, "--hf-checkpoint", str(moe_dir), "--use-rollout-routing-replay"])
    assert (
        cfg.algorithm.use_rollout_routing_replay and cfg.algorithm.use_routing_replay
    )  # slime: R3 implies R2
    r2 = resolve([*RUN, "--hf-checkpoint", str(moe_dir), "--use-routing-replay"]).algorithm
    assert r2.use_routing_replay and not r2.use_rollout_routing_replay
    assert moe_routing(str(moe_dir)) == MoeRouting(layers=2, topk=2, experts=4)
    assert moe_routing(str(tiny_model)) is None
    for flag in ("--use-routing-replay", "--use-rollout-routing-replay"):
        with pytest.raises(
            ConfigError, match=rf"{flag}=True: replays Mixture-of-Experts routing, but .* dense model"
        ):
            resolve([*RUN, "--hf-checkpoint", str(tiny_model), flag])
    with pytest.raises(
        ConfigError, match="--moe-router-load-balancing-type='sinkhorn': has no top-k routing"
    ):
        resolve(
            [
                *RUN,
                "--hf-checkpoint",
                str(moe_dir),
                "--use-routing-replay",
                "--moe-router-load-balancing-type",
                "sinkhorn",
            ]
        )


def test_slime_hooks_see_the_flags(moe_dir: Path) -> None:
    from tether.rollout.hooks.calls import FlatArgs
    from tether.rollout.slime_api.args import slime_args

    cfg = resolve([*RUN, "--hf-checkpoint", str(moe_dir), "--use-rollout-routing-replay"])
    args = FlatArgs(cfg, extra=slime_args(cfg, router_ip=None, router_port=None))
    assert args.use_rollout_routing_replay is True and args.use_routing_replay is True


def test_engines_record_routed_experts_for_r3() -> None:
    from support.engines import local_plan_engine
    from support.plans import sglang_cfg

    from tether.rollout.engine_api.launch import parse_flags, server_argv

    engine = local_plan_engine()
    for backend in ("sglang", "cpu"):
        on = server_argv(engine, engine.parts[0], sglang_cfg(backend=backend, return_routed_experts=True))
        off = server_argv(engine, engine.parts[0], sglang_cfg(backend=backend))
        # [python, -m, module, flags...]
        assert "enable-return-routed-experts" in parse_flags(on[3:], "argv"), on
        assert "enable-return-routed-experts" not in parse_flags(off[3:], "argv"), off


def test_external_engines_must_record_routed_experts() -> None:
    from tether.run.engine_pool import check_records_routed_experts

    check_records_routed_experts("http://e:1", {"enable_return_routed_experts": True})
    check_records_routed_experts("http://e:1", {"device": "cpu"})  # does not say: the first answer will
    with pytest.raises(
        ConfigError, match=r"external engine http://e:1 was started without --enable-return-routed"
    ):
        check_records_routed_experts("http://e:1", {"enable_return_routed_experts": False})
