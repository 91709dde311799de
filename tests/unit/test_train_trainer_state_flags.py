"""slime's trainer-state flags (issue #19) where their logic is pure or runs on small torch modules:
--ref-update-interval, --reset-optimizer-states, --keep-old-actor, --freeze-params-name-list,
--only-train-params-name-list, --check-weight-update-equal (the CPU engine's /weights_checker
and the head's snapshot → reset → update → compare). The same flags on real Megatron ranks:
tests/integration/test_train_trainer_state.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tether.config import Config, resolve
from tether.rollout.cpu_engine.weights.checker import CheckWeightsReq, WeightsChecker, WeightsCheckFailed
from tether.rollout.engine_api.client import EngineError
from tether.rollout.sample import Sample
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig
from tether.train.rank.work import WorkOptions, rollout_steps
from tether.train.state.old_actor import OldActor
from tether.train.state.optimizer_reset import reset_optimizer_states
from tether.train.state.param_freeze import apply_freeze, freeze_params
from tether.train.state.ref_update import ref_update_due, update_reference
from tether.train.state.weight_copies import WeightCopy, live_tensors, swapped_in

RUN = ["--num-rollout", "4", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]


def parse(*argv: str) -> Config:
    return resolve([*RUN, *argv])


# ----- the flags, with slime's names, types and defaults -----
def test_flags_parse_with_slimes_types_and_defaults() -> None:
    default = parse().algorithm
    assert default.ref_update_interval is None and not default.reset_optimizer_states
    assert not default.keep_old_actor and default.freeze_params_name_list is None
    assert default.only_train_params_name_list is None and not parse().debug.check_weight_update_equal
    cfg = parse(
        "--use-kl-loss",
        "--ref-update-interval",
        "3",
        "--reset-optimizer-states",
        "--keep-old-actor",
        "--freeze-params-name-list",
        "embedding",
        r"layers\.1\.",
        "--check-weight-update-equal",
    )
    a = cfg.algorithm
    assert a.ref_update_interval == 3 and a.reset_optimizer_states and a.keep_old_actor
    assert a.freeze_params_name_list == ["embedding", r"layers\.1\."]  # nargs="*"
    assert cfg.debug.check_weight_update_equal
    assert parse("--only-train-params-name-list", "output_layer").algorithm.only_train_params_name_list == [
        "output_layer"
    ]


@pytest.mark.parametrize(
    ("argv", "flag", "why"),
    [
        (
            ["--only-train-params-name-list", "a", "--freeze-params-name-list", "b"],
            "--only-train-params-name-list",
            "only one",
        ),
        (["--freeze-params-name-list", "layers.(1"], "--freeze-params-name-list", "not a regular expression"),
        (["--only-train-params-name-list"], "--only-train-params-name-list", "at least one"),
        (["--ref-update-interval", "2"], "--ref-update-interval", "no reference model"),
        (["--use-kl-loss", "--ref-update-interval", "0"], "--ref-update-interval", ">= 1"),
        (["--keep-old-actor", "--loss-type", "sft_loss"], "--keep-old-actor", "no old log-probs"),
        (["--keep-old-actor", "--use-rollout-logprobs"], "--keep-old-actor", "from the engines"),
    ],
)
def test_contradictions_are_refused_naming_the_flag(argv: list[str], flag: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        parse(*argv)
    assert err.value.key == flag


def test_check_weight_update_equal_needs_engines_and_a_trainer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--debug-rollout-only has none") as err:
        parse("--check-weight-update-equal", "--debug-rollout-only")
    assert err.value.key == "--check-weight-update-equal"
    saved = str(tmp_path / "{rollout_id}.pt")
    with pytest.raises(ConfigError, match="--debug-train-only has none"):
        parse("--check-weight-update-equal", "--debug-train-only", "--load-debug-rollout-data", saved)


# ----- --ref-update-interval -----
def test_ref_update_is_due_when_rollout_plus_one_is_a_multiple() -> None:
    assert [r for r in range(7) if ref_update_due(3, r)] == [2, 5]  # slime: (rollout_id + 1) % N == 0
    assert [r for r in range(3) if ref_update_due(1, r)] == [0, 1, 2]
    assert not any(ref_update_due(None, r) for r in range(5))


class Tiny(torch.nn.Module):
    """Megatron-like parameter names, and an MoE router's expert_bias buffer (which a forward reads)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(11, 4)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
        for layer in self.decoder.layers:
            layer.mlp = torch.nn.Module()
            layer.mlp.linear_fc1 = torch.nn.Linear(4, 4)
            layer.mlp.router = torch.nn.Module()
            layer.mlp.router.register_buffer("expert_bias", torch.zeros(3))
        self.output_layer = torch.nn.Linear(4, 11, bias=False)
        with torch.no_grad():
            for t in live_tensors([self]).values():
                t.copy_(torch.randn(t.shape, generator=g))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            h = torch.tanh(layer.mlp.linear_fc1(h)) + layer.mlp.router.expert_bias.sum()
        return torch.log_softmax(self.output_layer(h), dim=-1)


class Wrapped(torch.nn.Module):
    """As Megatron's DDP wraps a chunk (`.module`)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in live_tensors([m]).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reference_takes_the_actors_weights_and_then_its_log_probs() -> None:
    actor, ref = Wrapped(Tiny(1)), Tiny(2)
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert not torch.equal(actor.module(tokens), ref(tokens))
    update_reference([actor], [ref])
    assert torch.equal(actor.module(tokens), ref(tokens))  # the expert_bias buffers came along too
    assert same(weights(actor.module), weights(ref))
    # A model of another shape is refused by name, not copied in part.
    other = Tiny(3)
    other.output_layer = torch.nn.Linear(4, 12, bias=False)
    with pytest.raises(ValueError, match=r"output_layer\.weight"):
        update_reference([actor], [other])


# ----- --keep-old-actor -----
def train_a_little(m: torch.nn.Module, seed: int) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))


def test_old_actor_queue_with_update_interval_one_is_one_update_behind() -> None:
    actor = Tiny(1)
    w0 = weights(actor)
    old = OldActor([actor])
    train_a_little(actor, 10)  # rollout 0 trains: W1
    w1 = weights(actor)
    old.after_weight_update([actor], 1)  # engines get W1; old_actor <- rollout_actor (W0)
    assert same(old.old.tensors, w0)
    train_a_little(actor, 11)  # rollout 1 (generated with W0 in the one-step-off loop) trains: W2
    old.after_weight_update([actor], 1)  # old_actor <- W1, rollout_actor <- W2
    assert same(old.old.tensors, w1)
    assert old.rollout is not None and same(old.rollout.tensors, weights(actor))


def test_old_actor_with_a_longer_interval_follows_each_update() -> None:
    actor = Tiny(1)
    old = OldActor([actor])
    train_a_little(actor, 10)
    old.after_weight_update([actor], 2)  # old_actor <- the weights the engines now serve
    assert same(old.old.tensors, weights(actor)) and old.rollout is None
    train_a_little(actor, 11)
    loaded = weights(actor)
    old.restart([actor])  # a checkpoint was loaded: its weights are the start weights
    assert same(old.old.tensors, loaded)


def test_old_log_probs_use_the_old_weights_and_the_actors_come_back_exactly() -> None:
    actor = Tiny(1)
    tokens = torch.tensor([[1, 2, 3, 4]])
    at_start = actor(tokens)
    old = OldActor([actor])
    train_a_little(actor, 10)
    trained, now = actor(tokens), weights(actor)
    with old.active([actor]):
        assert torch.equal(actor(tokens), at_start)
    assert same(weights(actor), now) and torch.equal(actor(tokens), trained)
    with pytest.raises(RuntimeError, match="boom"), old.active([actor]):
        raise RuntimeError("boom")
    assert same(weights(actor), now)  # restored on the way out of a failure too


def test_weight_copies_live_on_the_host() -> None:
    m = Tiny(1)
    copy = WeightCopy([m])
    assert all(t.device.type == "cpu" for t in copy.tensors.values())
    stash = WeightCopy([m])
    train_a_little(m, 3)
    changed = weights(m)
    with swapped_in([m], copy, stash):
        assert not same(weights(m), changed)
    assert same(weights(m), changed)


def group(n: int = 2) -> list[list[Sample]]:
    return [
        [
            Sample(
                index=i,
                group_index=0,
                rollout_id=i,
                tokens=[1, 2, 3, 10 + i],
                response_length=1,
                loss_mask=[1],
                rollout_log_probs=[-0.5],
                reward=float(i % 2),
                status=Sample.Status.COMPLETED,
            )
            for i in range(n)
        ]
    ]


def test_keep_old_actor_asks_for_old_log_probs_even_for_one_on_policy_step() -> None:
    # slime computes the old log-probs (with old_actor) whenever --keep-old-actor is set.
    plain, keep = AlgorithmConfig(), AlgorithmConfig(keep_old_actor=True)
    (step,) = rollout_steps(group(), plain, WorkOptions(global_batch_size=2), dp_size=1)
    assert "actor" not in step.log_prob_models
    (step,) = rollout_steps(group(), keep, WorkOptions(global_batch_size=2), dp_size=1)
    assert step.log_prob_models[0] == "actor"


# ----- --freeze-params-name-list / --only-train-params-name-list -----
def test_freeze_list_freezes_what_a_pattern_searches_out() -> None:
    m = Tiny(1)
    result = freeze_params(m, None, ["embedding", r"layers\.1\."])
    assert result.frozen == [
        "embedding.word_embeddings.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc1.bias",
    ]
    assert result.matches == [1, 2]
    assert all(p.requires_grad for n, p in m.named_parameters() if n not in result.frozen)


def test_only_train_list_freezes_everything_else() -> None:
    m = Tiny(1)
    result = freeze_params(m, ["linear_fc1.weight", "output_layer"], None)
    assert result.trainable == [
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "output_layer.weight",
    ]


def test_a_frozen_parameter_keeps_its_value_and_gets_no_optimizer_state() -> None:
    m = Tiny(1)
    freeze_params(m, None, ["embedding", "linear_fc1"])
    before = weights(m)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    after = weights(m)
    for name in before:
        moved = not torch.equal(before[name], after[name])
        assert moved == (name == "0.output_layer.weight"), name  # the only trainable parameter
    assert len(opt.state) == 1


def test_a_list_that_matches_nothing_is_refused_and_a_dead_pattern_warned(
    capsys: pytest.CaptureFixture[str],
) -> None:
    algo = AlgorithmConfig(freeze_params_name_list=["no_such_layer", "nor_this"])
    with pytest.raises(ConfigError, match="matches no parameter") as err:
        apply_freeze(Tiny(1), algo, report=True)
    assert err.value.key == "--freeze-params-name-list" and err.value.value == "no_such_layer nor_this"
    with pytest.raises(ConfigError, match="matches no parameter"):
        apply_freeze(Tiny(1), AlgorithmConfig(only_train_params_name_list=["nothing"]), report=True)
    apply_freeze(Tiny(1), AlgorithmConfig(only_train_params_name_list=["output_layer", "typo_"]), report=True)
    err_text = capsys.readouterr().err
    assert "['typo_'] match no parameter" in err_text
    assert "1 of 6 parameters train: ['output_layer.weight']" in err_text


# ----- --reset-optimizer-states -----
def test_reset_zeroes_adams_moments_and_step_in_every_chained_optimizer() -> None:
    m = Tiny(1)
    params = list(m.parameters())
    adams = [torch.optim.Adam(params[:2], lr=0.1), torch.optim.Adam(params[2:], lr=0.1)]
    for _ in range(2):
        m(torch.tensor([[1, 2, 3]])).sum().backward()
        for a in adams:
            a.step()
    main_weights = weights(m)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=a) for a in adams])
    assert reset_optimizer_states(chained) == len(params)
    for a in adams:
        for state in a.state.values():
            assert float(state["step"]) == 0
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert same(weights(m), main_weights)  # the weights themselves are kept
    # A group-level step count (TE's FusedAdam keeps it there) is reset too.
    fused = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"step": 7}], state={}))
    reset_optimizer_states(fused)
    assert fused.optimizer.param_groups[0]["step"] == 0


# ----- --check-weight-update-equal: the CPU engine's /weights_checker -----
def engine_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(5, 3, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 3, generator=g),
    }


def test_weights_checker_snapshot_reset_compare() -> None:
    params = engine_params()
    loaded = {k: v.clone() for k, v in params.items()}
    checker = WeightsChecker()
    assert checker.handle(params, CheckWeightsReq(action="snapshot")) == {}
    checker.handle(params, CheckWeightsReq(action="reset_tensors"))
    assert all(not torch.equal(params[k], loaded[k]) for k in params)  # noise in [0, 1)
    assert all(bool((v >= 0).all() and (v < 1).all()) for v in params.values())
    # An update that restores every weight but one: compare names that one.
    params["model.embed_tokens.weight"].copy_(loaded["model.embed_tokens.weight"])
    with pytest.raises(
        WeightsCheckFailed, match=r"check tensor equality failed:\nname=model.layers.0.mlp.up_proj"
    ):
        checker.handle(params, CheckWeightsReq(action="compare"))
    params["model.layers.0.mlp.up_proj.weight"].copy_(loaded["model.layers.0.mlp.up_proj.weight"])
    checker.handle(params, CheckWeightsReq(action="compare"))
    with pytest.raises(WeightsCheckFailed, match="no snapshot"):  # compare consumed it, as in SGLang
        checker.handle(params, CheckWeightsReq(action="compare"))


def test_weights_checker_skips_names_and_refuses_unknown_actions() -> None:
    params = engine_params()
    checker = WeightsChecker()
    checker.handle(params, CheckWeightsReq(action="snapshot"))
    skip = ["up_proj"]
    before = params["model.layers.0.mlp.up_proj.weight"].clone()
    checker.handle(params, CheckWeightsReq(action="reset_tensors", skip_tensor_list=skip))
    assert torch.equal(params["model.layers.0.mlp.up_proj.weight"], before)
    params["model.layers.0.mlp.up_proj.weight"].add_(1.0)  # differs, but is skipped
    with pytest.raises(WeightsCheckFailed, match="embed_tokens") as err:
        checker.handle(params, CheckWeightsReq(action="compare", skip_tensor_list=skip))
    assert "up_proj" not in str(err.value)
    with pytest.raises(WeightsCheckFailed, match="Unsupported action='nope'"):
        checker.handle(params, CheckWeightsReq(action="nope"))
    out = checker.handle(params, CheckWeightsReq())  # SGLang's default action: checksum
    (rank,) = out["ranks"]
    assert set(rank["checksums"]) == set(params) and rank["parallelism_info"]["tp_size"] == 1
    assert len(out["per_engine_checksum"]) == 64


# ----- --check-weight-update-equal: the head's sequence -----
class FakeEngine:
    def __init__(self, name: str, mismatch: str | None = None) -> None:
        self.name, self.mismatch, self.calls = name, mismatch, []  # type: list[str]

    async def check_weights(self, action: str) -> Any:
        self.calls.append(action)
        if action == "compare" and self.mismatch is not None:
            raise EngineError(self.name, "/weights_checker", 400, self.mismatch)
        return {"success": True, "message": "Success."}


class FakeRouter:
    def __init__(self, engines: list[FakeEngine]) -> None:
        self.engines = engines

    async def broadcast(self, fn: Any) -> dict[str, Any]:
        return {e.name: await fn(e) for e in self.engines}


class FakeSteps:
    def __init__(self, router: FakeRouter) -> None:
        self.rollouts = SimpleNamespace(router=router)
        self.trainer = object()
        self.engines = SimpleNamespace(urls=["a", "b"])
        self.version = 0
        self.syncs: list[int] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.run_dir = SimpleNamespace(event=lambda kind, **kw: self.events.append((kind, kw)))
        self.log: list[str] = []

    async def sync_weights(self, rollout_id: int) -> int:
        self.log.append("sync")
        self.syncs.append(rollout_id)
        self.version += 1
        return self.version


def run_check(steps: FakeSteps, publish_in_resume: bool) -> int:
    from tether.run.weight_update_check import resume_checking_weight_update

    async def resume() -> int:
        steps.log.append("resume")
        if publish_in_resume:
            await steps.sync_weights(5)
            return 6
        return 0

    return asyncio.run(resume_checking_weight_update(steps, resume))  # type: ignore[arg-type]


def test_a_fresh_start_publishes_once_between_reset_and_compare() -> None:
    engines = [FakeEngine("e0"), FakeEngine("e1")]
    steps = FakeSteps(FakeRouter(engines))
    assert run_check(steps, publish_in_resume=False) == 0
    assert steps.log == ["resume", "sync"] and steps.syncs == [-1]  # slime always publishes at start
    assert all(e.calls == ["snapshot", "reset_tensors", "compare"] for e in engines)
    assert steps.events == [("weight_update_equal", {"version": 1, "engines": 2})]


def test_a_resume_that_published_is_not_published_again() -> None:
    steps = FakeSteps(FakeRouter([FakeEngine("e0")]))
    assert run_check(steps, publish_in_resume=True) == 6
    assert steps.syncs == [5]


def test_a_mismatch_fails_naming_the_engine_and_the_tensor() -> None:
    message = "check tensor equality failed:\nname=model.norm.weight max_abs_err=0.5"
    steps = FakeSteps(FakeRouter([FakeEngine("e0"), FakeEngine("e1", mismatch=message)]))
    from tether.run.weight_update_check import WeightUpdateMismatch

    with pytest.raises(WeightUpdateMismatch, match="engine e1: check tensor equality failed") as err:
        run_check(steps, publish_in_resume=False)
    assert "name=model.norm.weight" in str(err.value) and "engine e0" not in str(err.value)


# ----- the pool marks where a rollout starts and ends -----
def test_the_pool_marks_the_first_and_last_step_of_a_rollout() -> None:
    from tether.run.trainer_pool import TrainerPool
    from tether.train.rank.protocol import (
        LogProbsRequest,
        LogProbsResult,
        TrainRequest,
        TrainResult,
        WorkerInfo,
    )

    seen: list[TrainRequest] = []

    class Rank:
        async def compute_log_probs(self, request: LogProbsRequest) -> LogProbsResult:
            return LogProbsResult(log_probs=np.zeros(int(request.shard.response_lengths.sum()), np.float32))

        async def train(self, request: TrainRequest) -> TrainResult:
            seen.append(request)
            return TrainResult(metrics={"loss": 0.0})

    pool = TrainerPool.__new__(TrainerPool)
    pool.cfg = parse("--global-batch-size", "1", "--num-rollout", "1")
    pool.critic = None
    pool._train_data_hooks = None
    pool.checks = None
    pool.ranks = [Rank()]  # type: ignore[list-item]
    pool.infos = [WorkerInfo(rank=0, world_size=1, initialized=True)]
    pool.steps_done = 0
    asyncio.run(pool.train(7, group(4), weight_version=0))
    assert [(r.rollout_id, r.first_of_rollout, r.last_of_rollout) for r in seen] == [
        (7, True, False),
        (7, False, False),
        (7, False, False),
        (7, False, True),
    ]
