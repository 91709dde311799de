"""slime's Megatron hooks (--custom-megatron-init-path, --custom-megatron-before-log-prob-hook-path,
--custom-megatron-before-train-step-hook-path, --custom-model-provider-path): their plan-time checks,
where a rank calls them and with what (the rank's RPC methods in-process on stand-in models; the
passes' own order on stand-in chunks), and a provider-built model on a real one-rank tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.slime_hooks import megatron_hooks as hooks_file
from test_train_mtp import one_rank  # noqa: F401  (a one-rank gloo group in this process)

from tether.checks.megatron_hooks import check_megatron_hooks
from tether.config import resolve
from tether.runtime.errors import ConfigError
from tether.train.algorithms import critic as critic_passes
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.rank import step
from tether.train.rank.megatron_hooks import MegatronHooks
from tether.train.rank.protocol import InitRequest, LogProbsRequest, TrainRequest, ValuesRequest
from tether.train.rank.worker import TrainerWorker

HOOKS = "support.slime_hooks.megatron_hooks"
ALL_HOOKS = AlgorithmConfig(
    custom_megatron_init_path=f"{HOOKS}.custom_init",
    custom_megatron_before_log_prob_hook_path=f"{HOOKS}.before_log_prob",
    custom_megatron_before_train_step_hook_path=f"{HOOKS}.before_train_step",
)
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
RUN = ["--num-rollout", "10", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]


@pytest.fixture(autouse=True)
def calls() -> Iterator[list[Any]]:
    hooks_file.CALLS.clear()
    yield hooks_file.CALLS
    hooks_file.CALLS.clear()


# ---- flags and plan-time checks ----


def test_the_flags_parse_and_plan_checks_each_hook() -> None:
    cfg = resolve(
        [
            *RUN,
            "--custom-megatron-init-path",
            f"{HOOKS}.custom_init",
            "--custom-megatron-before-log-prob-hook-path",
            f"{HOOKS}.before_log_prob",
            "--custom-megatron-before-train-step-hook-path",
            f"{HOOKS}.before_train_step",
            "--custom-model-provider-path",
            f"{HOOKS}.model_provider",
        ]
    )
    assert cfg.algorithm.custom_megatron_init_path == f"{HOOKS}.custom_init"
    check_megatron_hooks(cfg.algorithm)  # all import and take their calls
    check_megatron_hooks(AlgorithmConfig(custom_model_provider_path=f"{HOOKS}.provider_without_vp_stage"))


@pytest.mark.parametrize(
    ("field", "path", "reason"),
    [
        ("custom_megatron_init_path", f"{HOOKS}.missing", "has no attribute 'missing'"),
        ("custom_megatron_before_log_prob_hook_path", "no_such_module_x.fn", "cannot be imported"),
        (
            "custom_megatron_before_train_step_hook_path",
            f"{HOOKS}.wrong_train_step_hook",
            r"cannot be called as fn\(args, rollout_id, step_id, model, optimizer, opt_param_scheduler\)",
        ),
        ("custom_model_provider_path", f"{HOOKS}.custom_init", r"cannot be called as fn\(pre_process="),
    ],
)
def test_a_hook_that_cannot_take_its_call_is_refused_naming_the_flag(
    field: str, path: str, reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason) as err:
        check_megatron_hooks(AlgorithmConfig(**{field: path}))
    assert (err.value.key, err.value.value) == ("--" + field.replace("_", "-"), path)


def test_a_layer_spec_beside_a_model_provider_is_refused() -> None:
    with pytest.raises(ConfigError, match="builds the model; a layer spec would not be used") as err:
        resolve(
            [
                *RUN,
                "--custom-model-provider-path",
                f"{HOOKS}.model_provider",
                "--spec",
                "slime_plugins.models.glm4",
                "get_glm_spec",
            ]
        )
    assert err.value.key == "--spec"


# ---- where the rank calls them ----


def _args_of(calls: list[Any]) -> Any:
    return calls[0][1][0]


def test_init_hook_runs_after_megatron_initialises_and_before_any_model_is_built(
    monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    from tether.train.model import build, hf_config
    from tether.train.parallel import topology

    topo = SimpleNamespace(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1, is_sync_source=True
    )
    monkeypatch.setattr(hf_config, "load_arch", lambda path: None)
    monkeypatch.setattr(hf_config, "check_architecture_flags", lambda arch, flags: None)
    monkeypatch.setattr(topology, "init_distributed", lambda **kw: calls.append(("distributed",)) or topo)
    monkeypatch.setattr(build, "build_actor", lambda *a, **kw: calls.append(("build",)) or SimpleNamespace())
    algorithm = AlgorithmConfig(custom_megatron_init_path=f"{HOOKS}.custom_init", lr=3e-6)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            worker = TrainerWorker(pool)
            await worker.init(
                InitRequest(hf_checkpoint="/hf", algorithm=algorithm, megatron=MegatronConfig())
            )

    asyncio.run(scenario())
    assert [c[0] for c in calls] == ["distributed", "init", "build"]
    args = calls[1][1][0]
    # slime's names for the rank's flags, the Megatron slice's too
    assert (args.lr, args.tensor_model_parallel_size, args.hf_checkpoint, args.rank) == (3e-6, 1, "/hf", 0)


def _worker(pool: ThreadPoolExecutor, role: str = "actor") -> tuple[TrainerWorker, Any]:
    worker = TrainerWorker(pool)
    actor = SimpleNamespace(
        chunks=["chunk"],
        optimizer="optimizer",
        scheduler="scheduler",
        config="config",
        arch=SimpleNamespace(vocab_size=8),
    )
    worker._actor, worker._algorithm, worker._role = actor, ALL_HOOKS, role
    worker._ref = SimpleNamespace(chunks=["ref chunk"], config="ref config")
    worker._megatron_hooks = MegatronHooks.load(ALL_HOOKS, MegatronConfig(), "/hf")
    return worker, actor


SHARD = SimpleNamespace(validate=lambda: None)


def test_train_step_hook_gets_slimes_arguments_for_the_actor_and_the_critic(
    monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    def fake_step(*args: Any, before: Any = None, **kwargs: Any) -> dict[str, float]:
        before()
        return {}

    monkeypatch.setattr(step, "train_step", fake_step)
    monkeypatch.setattr(critic_passes, "value_train_step", fake_step)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            for role in ("actor", "critic"):
                worker, _ = _worker(pool, role)
                await worker.train(TrainRequest(rollout_id=7, shard=SHARD, plan=[], step_id=2))  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert len(calls) == 2
    for name, (args, rollout_id, step_id, model, optimizer, scheduler), _ in calls:
        assert name == "train_step"
        assert (rollout_id, step_id, model, optimizer, scheduler) == (
            7,
            2,
            ["chunk"],
            "optimizer",
            "scheduler",
        )
        assert args.custom_megatron_before_train_step_hook_path == f"{HOOKS}.before_train_step"


def test_log_prob_hook_gets_each_passes_model_and_slimes_store_prefix(
    monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    def fake_pass(chunks: Any, *args: Any, before: Any = None, **kwargs: Any) -> Any:
        before()
        return torch.zeros(1).numpy(), None

    def fake_values(critic: Any, shard: Any, plan: Any, before: Any = None) -> Any:
        before()
        return torch.zeros(1).numpy()

    monkeypatch.setattr(step, "compute_log_probs", fake_pass)
    monkeypatch.setattr(critic_passes, "compute_values", fake_values)

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            worker, _ = _worker(pool)
            for model in ("actor", "ref"):
                await worker.compute_log_probs(LogProbsRequest(shard=SHARD, plan=[], model=model))  # type: ignore[arg-type]
            critic, _ = _worker(pool, "critic")
            await critic.compute_values(ValuesRequest(shard=SHARD, plan=[]))  # type: ignore[arg-type]

    asyncio.run(scenario())
    assert [(c[0], c[1][1], c[1][2]) for c in calls] == [
        ("log_prob", ["chunk"], ""),
        ("log_prob", ["ref chunk"], "ref_"),
        ("log_prob", ["chunk"], ""),
    ]


class _Stop(Exception):
    pass


class _Chunk:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def train(self) -> None:
        self.events.append("train mode")

    def eval(self) -> None:
        self.events.append("eval mode")

    def zero_grad_buffer(self) -> None:
        self.events.append("zero grad buffer")


def test_the_passes_call_before_after_zeroing_grads_or_eval_mode_and_before_any_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron.core import parallel_state

    events: list[str] = []

    def stop(*args: Any, **kwargs: Any) -> None:
        events.append("forward")
        raise _Stop

    monkeypatch.setattr(step, "build_micro_batches", stop)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    chunk = _Chunk(events)
    model = SimpleNamespace(
        chunks=[chunk], optimizer=SimpleNamespace(zero_grad=lambda: events.append("zero grad")), config=None
    )

    def before() -> None:
        events.append("hook")

    for run in (
        lambda: step.train_step(model, SHARD, [], AlgorithmConfig(), before=before),  # type: ignore[arg-type]
        lambda: critic_passes.value_train_step(
            model,
            SimpleNamespace(values=1, returns=1),  # type: ignore[arg-type]
            [],
            AlgorithmConfig(),
            before=before,
        ),
    ):
        events.clear()
        with pytest.raises(_Stop):
            run()
        assert events == ["train mode", "zero grad buffer", "zero grad", "hook", "forward"]
    for run in (
        lambda: step.compute_log_probs([chunk], None, 8, SHARD, [], before=before),  # type: ignore[arg-type]
        lambda: critic_passes.compute_values(model, SHARD, [], before=before),  # type: ignore[arg-type]
    ):
        events.clear()
        with pytest.raises(_Stop):
            run()
        assert events == ["eval mode", "hook", "forward"]


# ---- --custom-model-provider-path on a real tiny model ----


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", TinyModelSpec(arch="llama", seed=2))


def test_a_provider_built_model_takes_the_hf_weights_through_the_bridge(
    one_rank: Any,  # noqa: F811
    llama_dir: Path,
    calls: list[Any],
) -> None:
    from tether.train.model import build as tm

    megatron = MegatronConfig(lr_decay_style="constant")
    plain = tm.ModelOptions(hf_checkpoint=str(llama_dir), megatron=megatron)
    arch, _, own, weights = tm._prepare(plain, one_rank)
    tm.load_hf_weights([own], arch, llama_dir, one_rank, weights)
    hooks_file.PROVIDER_SHAPE.update(arch=arch, topo=one_rank)
    provided = tm.ModelOptions(
        hf_checkpoint=str(llama_dir),
        megatron=megatron,
        algorithm=AlgorithmConfig(custom_model_provider_path=f"{HOOKS}.model_provider"),
    )
    _, _, chunk, weights2 = tm._prepare(provided, one_rank)
    assert calls == [("provider", (), {"pre_process": True, "post_process": True, "vp_stage": None})]
    assert weights2.load(chunk, tm.HFWeights(llama_dir), tm.bridge.Layout.current()) > 0
    tokens = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6).expand(2, 6)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)[None, None]
    own.eval()
    chunk.eval()
    with torch.no_grad():
        assert torch.equal(chunk(tokens, pos, mask), own(tokens, pos, mask))


def test_a_provider_that_returns_no_module_is_refused(one_rank: Any, llama_dir: Path) -> None:  # noqa: F811
    from tether.train.model import build as tm

    opts = tm.ModelOptions(
        hf_checkpoint=str(llama_dir),
        megatron=MegatronConfig(lr_decay_style="constant"),
        algorithm=AlgorithmConfig(custom_model_provider_path=f"{HOOKS}.provider_without_vp_stage"),
    )
    with pytest.raises(ConfigError, match=r"returned object, not a torch\.nn\.Module") as err:
        tm._prepare(opts, one_rank)
    assert err.value.key == "--custom-model-provider-path"
