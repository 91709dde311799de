"""On-policy distillation (--use-opd): the flags' checks, the teacher log-probs carried from the
Samples to the trainer's batch, the advantage penalty A - coef x (student - teacher) on every
response token before whitening (hand-computed), which log-probs a step asks the ranks for, the
opd_reverse_kl metric, and slime's rollout-side hooks (slime.rollout.on_policy_distillation)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tether.config import resolve
from tether.rollout.sample import Sample, SampleContractError, validate_sample
from tether.rollout.slime_api.convert import copy_back, from_slime, to_slime
from tether.runtime.errors import ConfigError
from tether.train.algorithms.advantages import whiten
from tether.train.algorithms.opd_teacher import teacher_checkpoint
from tether.train.config import AlgorithmConfig
from tether.train.rank.batching import build_train_batch
from tether.train.rank.work import WorkOptions, rollout_steps

STUDENT = [[-0.5, -1.0, -0.25], [-2.0, -0.5]]  # the engine's log-probs of each response token
TEACHER = [[-0.25, -2.0, -0.25], [-1.0, -1.5]]


def sample(i: int, reward: float, *, teacher: bool = True, mask: list[int] | None = None) -> Sample:
    n = len(STUDENT[i])
    return Sample(
        index=i,
        group_index=0,
        rollout_id=i,
        tokens=[1, 2, 3, *[10 + i + k for k in range(n)]],
        response_length=n,
        loss_mask=mask or [1] * n,
        rollout_log_probs=list(STUDENT[i]),
        teacher_log_probs=list(TEACHER[i]) if teacher else None,
        reward=reward,
        status=Sample.Status.COMPLETED,
    )


def one_group(**kw: Any) -> list[list[Sample]]:
    return [[sample(0, 1.0, **kw), sample(1, 0.0, **kw)]]


def megatron_dir(root: Path) -> Path:
    """A directory that looks like a Megatron checkpoint to the flag checks (its tracker file)."""
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    return root


# ----- the flags -----
@pytest.mark.parametrize(
    ("fields", "flag", "why"),
    [
        ({"use_opd": True}, "--opd-type", "must be set with --use-opd"),
        ({"opd_teacher_load": "/x"}, "--opd-teacher-load", "--use-opd is not enabled"),
        ({"opd_type": "sglang"}, "--opd-type", "--use-opd is not enabled"),
        ({"opd_kl_coef": 0.5}, "--opd-kl-coef", "--use-opd is not enabled"),
        ({"use_opd": True, "opd_type": "megatron"}, "--opd-teacher-load", "required by --opd-type megatron"),
        ({"use_opd": True, "opd_type": "sglang", "opd_teacher_load": "/x"}, "--opd-teacher-load", "must not"),
        (
            {"use_opd": True, "opd_type": "sglang", "opd_teacher_ckpt_step": 3},
            "--opd-teacher-ckpt-step",
            "needs --opd-type megatron",
        ),
        (
            {"use_opd": True, "opd_type": "megatron", "opd_teacher_load": "/no/such/dir"},
            "--opd-teacher-load",
            "exist",
        ),
        ({"use_opd": True, "opd_type": "sglang", "loss_type": "sft_loss"}, "--use-opd", "advantages"),
    ],
)
def test_opd_flags_are_checked_as_slime_checks_them(fields: dict[str, Any], flag: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        AlgorithmConfig(**fields)
    assert err.value.key == flag


def test_teacher_load_must_hold_a_megatron_checkpoint_or_an_hf_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no Megatron checkpoint") as err:
        AlgorithmConfig(use_opd=True, opd_type="megatron", opd_teacher_load=str(tmp_path))
    assert err.value.key == "--opd-teacher-load"
    AlgorithmConfig(use_opd=True, opd_type="megatron", opd_teacher_load=str(megatron_dir(tmp_path)))


def test_teacher_ckpt_step_must_name_an_existing_iteration(tmp_path: Path) -> None:
    (tmp_path / "iter_0000007").mkdir()
    cfg = AlgorithmConfig(
        use_opd=True, opd_type="megatron", opd_teacher_load=str(tmp_path), opd_teacher_ckpt_step=7
    )
    assert teacher_checkpoint(cfg) == tmp_path / "iter_0000007"
    plain = AlgorithmConfig(use_opd=True, opd_type="megatron", opd_teacher_load=str(megatron_dir(tmp_path)))
    assert teacher_checkpoint(plain) == tmp_path
    with pytest.raises(ConfigError, match="iter_0000008 does not exist") as err:
        AlgorithmConfig(
            use_opd=True, opd_type="megatron", opd_teacher_load=str(tmp_path), opd_teacher_ckpt_step=8
        )
    assert err.value.key == "--opd-teacher-ckpt-step"


def test_cli_flags_reach_the_algorithm_with_slimes_defaults(tmp_path: Path) -> None:
    base = ["--hf-checkpoint", str(tmp_path), "--rollout-batch-size", "2", "--num-rollout", "1"]
    megatron_dir(tmp_path)
    cfg = resolve([*base, "--use-opd", "--opd-type", "megatron", "--opd-teacher-load", str(tmp_path)])
    alg = cfg.algorithm
    assert (alg.use_opd, alg.opd_type, alg.opd_kl_coef, alg.opd_teacher_load) == (
        True,
        "megatron",
        1.0,
        str(tmp_path),
    )
    with pytest.raises(ConfigError, match="--opd-type"):
        resolve([*base, "--use-opd", "--opd-type", "vllm"])
    with pytest.raises(ConfigError) as err:
        resolve([*base, "--opd-teacher-load", str(tmp_path)])
    assert err.value.key == "--opd-teacher-load"


# ----- the Sample contract and the batch -----
def test_the_batch_carries_teacher_log_probs_through_steps_and_shards() -> None:
    samples = [sample(0, 1.0), sample(1, 0.0)]
    batch = build_train_batch(samples, rewards=[1.0, 0.0])
    assert batch.teacher_log_probs is not None
    assert batch.teacher_log_probs.tolist() == [*TEACHER[0], *TEACHER[1]]
    flipped = batch.select([1, 0])
    assert flipped.teacher_log_probs is not None and flipped.teacher_log_probs.tolist() == [
        *TEACHER[1],
        *TEACHER[0],
    ]
    assert build_train_batch([sample(0, 1.0, teacher=False)], rewards=[1.0]).teacher_log_probs is None


def test_teacher_log_probs_must_cover_the_response_on_every_sample() -> None:
    with pytest.raises(SampleContractError, match=r"teacher_log_probs.*missing on samples \[1\]"):
        build_train_batch([sample(0, 1.0), sample(1, 0.0, teacher=False)], rewards=[1.0, 0.0])
    short = sample(0, 1.0)
    short.teacher_log_probs = [-1.0]
    with pytest.raises(SampleContractError, match="teacher_log_probs=1 entries for response_length=3"):
        build_train_batch([short], rewards=[1.0])
    with pytest.raises(SampleContractError, match="teacher_log_probs"):
        validate_sample(short)
    assert validate_sample(sample(0, 1.0)) == 3


# ----- the advantages -----
def rkl(i: int) -> list[float]:
    return [s - t for s, t in zip(STUDENT[i], TEACHER[i], strict=True)]


def test_sglang_teacher_with_rollout_log_probs_penalises_every_response_token() -> None:
    """grpo: rewards 1 and 0 in one group -> +-0.7071 (std over 2); then minus coef x (student - teacher),
    on masked tokens too (slime applies it before the loss mask acts)."""
    algorithm = AlgorithmConfig(use_opd=True, opd_type="sglang", opd_kl_coef=0.5, use_rollout_logprobs=True)
    groups = [[sample(0, 1.0, mask=[1, 0, 1]), sample(1, 0.0)]]
    (step,) = rollout_steps(groups, algorithm, WorkOptions(global_batch_size=2), dp_size=1)
    assert step.log_prob_models == ()  # nothing to compute: both log-probs came with the Samples
    (req,) = step.train_requests(0)
    base = 1 / np.sqrt(2) / (1 + 1e-6 * np.sqrt(2))  # (r - mean) / (std + eps), std = sqrt(0.5)
    want = [base - 0.5 * d for d in rkl(0)] + [-base - 0.5 * d for d in rkl(1)]
    assert req.shard.advantages is not None
    np.testing.assert_allclose(req.shard.advantages, want, rtol=1e-5)
    # first token: student -0.5, teacher -0.25 -> d = -0.25 -> A = base - 0.5 x (-0.25)
    assert req.shard.advantages[0] == pytest.approx(base + 0.125, rel=1e-5)
    # the metric averages over trainable tokens only (the masked token's 1.0 is left out)
    metric = step.opd_metrics(per_token_loss=True)
    assert metric == {"opd_reverse_kl": pytest.approx((-0.25 + 0.0 - 1.0 + 1.0) / 4)}


def test_the_penalty_comes_before_whitening() -> None:
    algorithm = AlgorithmConfig(
        use_opd=True, opd_type="sglang", use_rollout_logprobs=True, normalize_advantages=True
    )
    (step,) = rollout_steps(one_group(), algorithm, WorkOptions(global_batch_size=2), dp_size=1)
    (req,) = step.train_requests(0)
    base = 1 / np.sqrt(2) / (1 + 1e-6 * np.sqrt(2))
    raw = torch.tensor([base - d for d in rkl(0)] + [-base - d for d in rkl(1)], dtype=torch.float64)
    want = whiten(raw, torch.ones(5))
    np.testing.assert_allclose(req.shard.advantages, want.numpy(), rtol=1e-5)


def test_trainer_student_log_probs_are_asked_for_and_used() -> None:
    """Without --use-rollout-logprobs the student is the actor's forward before the step (slime)."""
    algorithm = AlgorithmConfig(use_opd=True, opd_type="sglang", disable_rewards_normalization=True)
    (step,) = rollout_steps(one_group(), algorithm, WorkOptions(global_batch_size=2), dp_size=2)
    assert step.log_prob_models == ("actor",) and all(s.advantages is None for s in step.shards)
    old = [np.full(s.loss_masks.size, -3.0, dtype=np.float32) for s in step.shards]
    step.with_log_probs({"actor": old})
    rewards = {0: 1.0, 1: 0.0}
    for shard in step.shards:
        i = int(shard.sample_indices[0])
        assert shard.advantages is not None
        np.testing.assert_allclose(shard.advantages, [rewards[i] - (-3.0 - t) for t in TEACHER[i]], rtol=1e-6)


def test_megatron_teacher_log_probs_come_from_the_ranks(tmp_path: Path) -> None:
    algorithm = AlgorithmConfig(
        use_opd=True,
        opd_type="megatron",
        opd_teacher_load=str(megatron_dir(tmp_path)),
        opd_kl_coef=2.0,
        use_rollout_logprobs=True,
        disable_rewards_normalization=True,
    )
    groups = one_group(teacher=False)
    (step,) = rollout_steps(groups, algorithm, WorkOptions(global_batch_size=2), dp_size=1)
    assert step.log_prob_models == ("teacher",)
    (req,) = step.log_prob_requests("teacher")
    assert req.model == "teacher"
    teacher = np.array([*TEACHER[0], *TEACHER[1]], dtype=np.float32)
    step.with_log_probs({"teacher": [teacher]})
    (train,) = step.train_requests(0)
    assert train.shard.teacher_log_probs is not None
    want = [1.0 - 2.0 * d for d in rkl(0)] + [0.0 - 2.0 * d for d in rkl(1)]
    np.testing.assert_allclose(train.shard.advantages, want, rtol=1e-6)
    # default loss weights: 1 / trainable tokens of the step, the same mean as per-token
    mean = sum(rkl(0) + rkl(1)) / 5
    assert step.opd_metrics(per_token_loss=False)["opd_reverse_kl"] == pytest.approx(mean)


def test_megatron_opd_asks_for_actor_and_teacher_log_probs(tmp_path: Path) -> None:
    algorithm = AlgorithmConfig(
        use_opd=True, opd_type="megatron", opd_teacher_load=str(megatron_dir(tmp_path))
    )
    (step,) = rollout_steps(one_group(teacher=False), algorithm, WorkOptions(global_batch_size=2), dp_size=1)
    assert step.log_prob_models == ("actor", "teacher")


def test_sglang_opd_without_teacher_log_probs_names_the_hooks() -> None:
    algorithm = AlgorithmConfig(use_opd=True, opd_type="sglang", use_rollout_logprobs=True)
    with pytest.raises(
        ValueError, match=re.escape("slime.rollout.on_policy_distillation.post_process_rewards")
    ):
        rollout_steps(one_group(teacher=False), algorithm, WorkOptions(global_batch_size=2), dp_size=1)


def test_without_opd_there_is_no_metric_and_no_penalty() -> None:
    (step,) = rollout_steps(one_group(), AlgorithmConfig(), WorkOptions(global_batch_size=2), dp_size=1)
    assert step.opd_metrics(per_token_loss=False) == {}
    (req,) = step.train_requests(0)
    assert req.shard.advantages is not None
    assert len(set(req.shard.advantages[:3].tolist())) == 1  # the sample's advantage on every token


# ----- slime's rollout-side hooks -----
def teacher_answer(tokens: list[int]) -> dict[str, Any]:
    """What SGLang's /generate answers with return_logprob and logprob_start_len 0."""
    entries: list[list[Any]] = [[None, tokens[0], None]]
    entries += [[-0.1 * (t % 7) - 0.05, t, None] for t in tokens[1:]]
    return {"text": "", "meta_info": {"input_token_logprobs": entries, "finish_reason": {"type": "length"}}}


def test_post_process_rewards_puts_the_response_log_probs_on_slime_samples() -> None:
    from tether.rollout.slime_api.rollout import on_policy_distillation as opd_hooks

    tether_samples = [sample(0, 0.0, teacher=False), sample(1, 0.0, teacher=False)]
    for s in tether_samples:
        s.reward = teacher_answer(s.tokens)
    given = [to_slime(s) for s in tether_samples]
    args = type("Args", (), {"reward_key": None})()
    raw, rewards = opd_hooks.post_process_rewards(args, given)
    assert raw == rewards == [0.0, 0.0]
    for slime_sample, s in zip(given, tether_samples, strict=True):
        assert isinstance(slime_sample.teacher_log_probs, torch.Tensor)
        copy_back(slime_sample, s)  # what the head does after the hook
        want = [-0.1 * (t % 7) - 0.05 for t in s.tokens[-s.response_length :]]
        assert s.teacher_log_probs == pytest.approx(want)
    assert from_slime(to_slime(tether_samples[0])).teacher_log_probs == tether_samples[0].teacher_log_probs


def test_post_process_rewards_refuses_a_reward_that_is_no_teacher_answer() -> None:
    from tether.rollout.slime_api.rollout import on_policy_distillation as opd_hooks

    s = to_slime(sample(0, 1.0, teacher=False))
    with pytest.raises(ValueError, match="input_token_logprobs"):
        opd_hooks.post_process_rewards(type("Args", (), {"reward_key": None})(), [s])


def test_reward_func_asks_the_teacher_to_score_the_sample_tokens() -> None:
    from aiohttp import web

    from tether.rollout.slime_api.rollout import on_policy_distillation as opd_hooks

    seen: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        return web.json_response(teacher_answer(body["input_ids"]))

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            args = type(
                "Args", (), {"rm_url": f"http://127.0.0.1:{port}/generate", "rollout_temperature": 0.7}
            )()
            return await opd_hooks.reward_func(args, to_slime(sample(1, 0.0, teacher=False)))
        finally:
            await runner.cleanup()

    answer = asyncio.run(main())
    (body,) = seen
    assert body["input_ids"] == sample(1, 0.0).tokens
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    assert body["sampling_params"] == {"temperature": 0.7, "max_new_tokens": 0, "skip_special_tokens": False}
    assert answer == teacher_answer(body["input_ids"])


def test_slime_module_path_resolves_to_ours() -> None:
    from tether.rollout.hooks.calls import load_function
    from tether.rollout.slime_api.rollout import on_policy_distillation as opd_hooks

    assert load_function("slime.rollout.on_policy_distillation.reward_func") is opd_hooks.reward_func


def test_the_heads_post_process_hook_keeps_the_teacher_log_probs_on_tethers_samples(tmp_path: Path) -> None:
    """--custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards gets
    slime's Samples; what it sets on them reaches the Samples the trainer's batch is built from."""
    from tether.run.train_data_hooks import load_train_data_hooks

    cfg = resolve(
        [
            *("--hf-checkpoint", str(tmp_path), "--rollout-batch-size", "2", "--num-rollout", "1"),
            *(
                "--custom-reward-post-process-path",
                "slime.rollout.on_policy_distillation.post_process_rewards",
            ),
        ]
    )
    hooks = load_train_data_hooks(cfg)
    assert hooks is not None and hooks.reward_post_process is not None
    samples = [sample(0, 0.0, teacher=False), sample(1, 0.0, teacher=False)]
    for s in samples:
        s.reward = teacher_answer(s.tokens)
    raw, rewards = hooks.reward_post_process(samples)
    assert list(raw) == list(rewards) == [0.0, 0.0]
    for s in samples:
        assert s.teacher_log_probs == pytest.approx(
            [-0.1 * (t % 7) - 0.05 for t in s.tokens[-s.response_length :]]
        )


def test_rollout_metrics_leave_out_the_mean_of_teacher_answers() -> None:
    """The rollout's rewards are the teacher server's answers (dicts) until the post-process hook
    makes them scalar on the trainer's side: no reward mean, and no error, for them."""
    from tether.rollout.rollout_fn import rollout_metrics

    groups = one_group(teacher=False)
    for s in groups[0]:
        s.reward = teacher_answer(s.tokens)
    metrics = rollout_metrics(groups, None, 1.0)
    assert "rollout/reward_mean" not in metrics and metrics["rollout/samples"] == 2
    assert rollout_metrics(one_group(), None, 1.0)["rollout/reward_mean"] == 0.5
