"""PPO with a critic (--advantage-estimator ppo): GAE and the clipped value loss on hand-computed
tensors, the critic's rollout work (values back to their samples, returns, steps), the actor's
advantages from the critic's values, the value head, and the parse/plan rules (slime's: ppo needs
no critic flag; the critic shares the actor's devices)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tether.config import resolve
from tether.rollout.sample import Sample
from tether.run.job import _start_trainers, make_plan
from tether.runtime.errors import ConfigError
from tether.train.algorithms.advantages import compute_advantages
from tether.train.algorithms.critic_work import CriticWork
from tether.train.algorithms.gae import gae, ppo_token_rewards, value_loss
from tether.train.config import AlgorithmConfig
from tether.train.data.hooks import TrainDataHooks
from tether.train.model.value_head import ValueHead, attach_value_head
from tether.train.rank.work import WorkOptions, rollout_steps

# Two samples: response lengths 3 and 2, values V, token rewards r, gamma 0.9, lambd 0.8 (gl = 0.72).
# Sample 0: V = [0.5, 0.2, 0.1], r = [0, 0, 1]
#   deltas: d2 = 1 - 0.1 = 0.9; d1 = 0.9*0.1 - 0.2 = -0.11; d0 = 0.9*0.2 - 0.5 = -0.32
#   A2 = 0.9; A1 = -0.11 + 0.72*0.9 = 0.538; A0 = -0.32 + 0.72*0.538 = 0.06736
# Sample 1: V = [1.0, 0.0], r = [0, 2]: d1 = 2; d0 = 0 - 1 = -1; A1 = 2; A0 = -1 + 0.72*2 = 0.44
VALUES = [0.5, 0.2, 0.1, 1.0, 0.0]
TOKEN_REWARDS = [0.0, 0.0, 1.0, 0.0, 2.0]
ADVANTAGES = [0.06736, 0.538, 0.9, 0.44, 2.0]
RETURNS = [a + v for a, v in zip(ADVANTAGES, VALUES, strict=True)]


def test_gae_matches_the_hand_computed_recursion_per_sample() -> None:
    adv, ret = gae(torch.tensor(TOKEN_REWARDS), torch.tensor(VALUES), [3, 2], gamma=0.9, lambd=0.8)
    assert adv.tolist() == pytest.approx(ADVANTAGES, abs=1e-6)
    assert ret.tolist() == pytest.approx(RETURNS, abs=1e-6)


def test_gae_with_gamma_and_lambda_one_and_zero_values_is_the_reward_on_every_token() -> None:
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0, 0.0, 2.0]), torch.zeros(5), [3, 2], gamma=1.0, lambd=1.0)
    assert adv.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0] and ret.tolist() == adv.tolist()


def test_token_rewards_put_the_reward_on_the_last_token_and_shape_with_kl() -> None:
    plain = ppo_token_rewards(torch.tensor([1.0, 2.0]), [2, 1])
    assert plain.tolist() == [0.0, 1.0, 2.0]
    shaped = ppo_token_rewards(
        torch.tensor([1.0, 2.0]), [2, 1], kl=torch.tensor([0.1, 0.2, 0.3]), kl_coef=0.5
    )
    assert shaped.tolist() == pytest.approx([-0.05, 0.9, 1.85])


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors() -> None:
    # Token 0: V 1.0, old 0.5 (clip 0.2 -> 0.7), R 2: max((0.7-2)^2, (1-2)^2) = 1.69, clipped.
    # Token 1: V 0.0, old 0.05 (inside the clip), R -1: (0 - -1)^2 = 1.
    values = torch.tensor([1.0, 0.0], requires_grad=True)
    loss, metrics = value_loss(
        values, torch.tensor([0.5, 0.05]), torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.5]), 0.2
    )
    assert float(loss.detach()) == pytest.approx(0.5 * 1.69 + 0.5 * 1.0)
    assert float(metrics["value_clipfrac"]) == pytest.approx(0.5)
    loss.backward()
    assert values.grad is not None
    # The clipped branch won on token 0: no gradient moves that value further (PPO value clipping).
    assert values.grad.tolist() == pytest.approx([0.0, 0.5 * 2 * (0.0 + 1.0)])


def test_ppo_advantages_are_gae_of_the_reward_on_the_last_token_and_whitened_on_request() -> None:
    cfg = AlgorithmConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
    kwargs = {
        "rewards": torch.tensor([1.0, 2.0]),
        "response_lengths": [3, 2],
        "loss_mask": torch.ones(5),
        "values": torch.tensor(VALUES),
    }
    assert compute_advantages(cfg, **kwargs).tolist() == pytest.approx(ADVANTAGES, abs=1e-6)
    whitened = compute_advantages(
        AlgorithmConfig(advantage_estimator="ppo", normalize_advantages=True), **kwargs
    )
    assert float(whitened.mean()) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="critic's values"):
        compute_advantages(
            cfg, rewards=torch.tensor([1.0, 2.0]), response_lengths=[3, 2], loss_mask=torch.ones(5)
        )


def test_ppo_kl_shaping_uses_the_old_and_reference_log_probs() -> None:
    cfg = AlgorithmConfig(advantage_estimator="ppo", kl_coef=0.5, kl_loss_type="k1")
    lp, ref = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.2, -1.0, -0.6])  # k1 kl: 0.2, 0, -0.4
    adv = compute_advantages(
        cfg,
        rewards=torch.tensor([1.0]),
        response_lengths=[3],
        loss_mask=torch.ones(3),
        log_probs=lp,
        ref_log_probs=ref,
        values=torch.zeros(3),
    )
    # gamma = lambd = 1, V = 0: the reward-to-go of r = [-0.1, 0, 1 + 0.2].
    assert adv.tolist() == pytest.approx([1.1, 1.2, 1.2])


def samples(n: int) -> list[list[Sample]]:
    out = []
    for g in range(n // 2):
        group = []
        for j in range(2):
            i = 2 * g + j
            resp = 2 + i % 3
            group.append(
                Sample(
                    index=i,
                    group_index=g,
                    rollout_id=i,
                    tokens=[(i * 7 + k) % 30 + 1 for k in range(3 + resp)],
                    response_length=resp,
                    loss_mask=[1] * resp,
                    reward=float(i % 3),
                )
            )
        out.append(group)
    return out


def test_critic_values_go_back_to_their_samples_and_feed_returns_and_the_actors_advantages() -> None:
    algo = AlgorithmConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.95)
    options = WorkOptions(global_batch_size=4, balance_data=True)
    work = CriticWork.build(samples(8), algo, options, dp_size=3)
    batch = work.batch
    ro = batch.response_offsets
    truth = np.arange(int(ro[-1]), dtype=np.float32) / 10  # a distinct value per response token
    requests = work.value_requests()
    assert len(requests) == 3 and len({r.shard.num_samples for r in requests}) == 1  # filler evens them
    # What each rank would compute: the value of each of its shard's tokens, found by the tokens.
    per_dp = []
    for r in requests:
        got = []
        for k in range(r.shard.num_samples):
            i = next(
                i
                for i in range(batch.num_samples)
                if np.array_equal(batch.sample_tokens(i), r.shard.sample_tokens(k))
            )
            got.append(truth[ro[i] : ro[i + 1]])
        per_dp.append(np.concatenate(got))
    values = work.with_values(per_dp)
    assert values.tolist() == truth.tolist()
    lengths = batch.response_lengths.tolist()
    expect = gae(
        ppo_token_rewards(torch.from_numpy(batch.rewards), lengths),
        torch.from_numpy(truth),
        lengths,
        gamma=0.9,
        lambd=0.95,
    )[1]
    assert batch.returns is not None and batch.returns.tolist() == pytest.approx(expect.tolist(), abs=1e-6)
    steps = work.train_requests(rollout_id=5)
    assert len(steps) == 2 and all(len(s) == 3 for s in steps)  # 8 samples, 4 per step, 3 DP ranks
    for step in steps:
        for r in step:
            assert r.shard.values is not None and r.shard.returns is not None and r.rollout_id == 5
    # The actor: GAE advantages from the same values (kl_coef 0: the critic's returns minus values).
    (actor_step,) = rollout_steps(
        samples(8), algo, WorkOptions(global_batch_size=8), dp_size=1, values=values
    )
    (shard,) = [r.shard for r in actor_step.train_requests(5)]
    assert shard.advantages is not None
    assert shard.advantages.tolist() == pytest.approx((batch.returns - truth).tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="critic's values"):
        rollout_steps(samples(8), algo, WorkOptions(global_batch_size=8), dp_size=1)


def test_value_head_is_seeded_one_wide_and_ignores_the_vocab_projection_arguments() -> None:
    config = SimpleNamespace(
        params_dtype=torch.float32, sequence_parallel=False, init_method_std=0.02, hidden_size=8
    )
    a, b = ValueHead(8, config, seed=3), ValueHead(8, config, seed=3)
    assert torch.equal(a.weight, b.weight) and a.weight.shape == (1, 8) and a.bias.tolist() == [0.0]
    assert 0 < a.weight.detach().std().item() < 0.1
    hidden = torch.randn(5, 2, 8)  # [s, b, h] as GPTModel calls its output layer
    out, bias = a(hidden, weight=torch.randn(100, 8), runtime_gather_output=True)
    assert bias is None and out.shape == (5, 2, 1) and out.dtype == torch.float32
    assert torch.allclose(out, hidden @ a.weight.T)
    chunk = SimpleNamespace(
        output_layer=object(), post_process=True, pre_process=True, share_embeddings_and_output_weights=True
    )
    assert attach_value_head(chunk, config, seed=3)
    assert isinstance(chunk.output_layer, ValueHead) and chunk.share_embeddings_and_output_weights is False
    assert not attach_value_head(SimpleNamespace(output_layer=None), config, seed=3)  # not the last stage


def test_critic_settings_without_ppo_are_refused_and_lambd_is_free_under_ppo() -> None:
    for kwargs, flag in (
        ({"lambd": 0.95}, "--lambd"),
        ({"value_clip": 0.3}, "--value-clip"),
        ({"num_critic_only_steps": 2}, "--num-critic-only-steps"),
    ):
        with pytest.raises(ConfigError) as err:
            AlgorithmConfig(**kwargs)  # type: ignore[arg-type]
        assert err.value.key == flag and "ppo" in str(err.value)
        AlgorithmConfig(advantage_estimator="ppo", **kwargs)  # type: ignore[arg-type]


RUN = ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--cpu-devices", "3"]


def test_ppo_places_a_critic_on_the_actors_devices_without_any_critic_flag() -> None:
    cfg = resolve(
        [*RUN, "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1", "--advantage-estimator", "ppo"]
    )
    assert (cfg.algorithm.value_clip, cfg.algorithm.num_critic_only_steps) == (0.2, 0)
    plan = make_plan(cfg)
    actor, critic = plan.train_group("actor"), plan.train_group("critic")
    assert actor is not None and critic is not None
    assert critic.shares_devices_with == "actor" and critic.world_size == actor.world_size == 2
    assert [n.devices for n in critic.nodes] == [n.devices for n in actor.nodes]
    assert critic.rdzv_endpoint != actor.rdzv_endpoint
    grpo = make_plan(resolve([*RUN, "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1"]))
    assert grpo.train_group("critic") is None


def test_critic_placement_flags_without_ppo_are_refused_at_parse_time() -> None:
    with pytest.raises(ConfigError) as err:
        resolve([*RUN, "--critic-num-nodes", "1"])
    assert err.value.key == "--critic-num-nodes" and "--advantage-estimator ppo" in str(err.value)
    parsed = resolve(
        [*RUN, "--advantage-estimator", "ppo", "--value-clip", "0.5", "--num-critic-only-steps", "1"]
    )
    assert (parsed.algorithm.value_clip, parsed.algorithm.num_critic_only_steps) == (0.5, 1)


class FakePool:
    """Stands in for a TrainerPool's start and stop (no processes)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.entered, self.exited = fail, False, False

    async def __aenter__(self) -> FakePool:
        await asyncio.sleep(0)
        if self.fail:
            raise ConfigError("--hf-checkpoint", "x", "cannot build the critic")
        self.entered = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.exited = True


def test_trainer_jobs_start_side_by_side_and_the_first_failure_comes_out_plain() -> None:
    async def start(pools: list[FakePool]) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await _start_trainers(stack, pools)  # type: ignore[arg-type]

    ok = [FakePool(), FakePool()]
    asyncio.run(start(ok))
    assert all(p.entered and p.exited for p in ok)
    good, bad = FakePool(), FakePool(fail=True)
    with pytest.raises(ConfigError, match="cannot build the critic"):  # not an ExceptionGroup
        asyncio.run(start([good, bad]))
    assert good.entered and good.exited  # the pool that did start is stopped with the run


def test_the_custom_advantage_hook_sees_the_critics_values_under_ppo() -> None:
    seen: list[list[float]] = []

    def hook(rollout_data: dict) -> None:  # type: ignore[type-arg]
        seen.extend(v.tolist() for v in rollout_data["values"])
        rollout_data["advantages"] = [v * 2 for v in rollout_data["values"]]
        rollout_data["returns"] = list(rollout_data["values"])

    algo = AlgorithmConfig(advantage_estimator="ppo", custom_advantage_function_path="m.hook")
    batch_samples = samples(4)
    n = sum(s.response_length for g in batch_samples for s in g)
    values = np.arange(n, dtype=np.float32)
    hooks = TrainDataHooks(advantage=hook, advantage_path="m.hook")
    (step,) = rollout_steps(
        batch_samples, algo, WorkOptions(global_batch_size=4), dp_size=1, hooks=hooks, values=values
    )
    assert [x for v in seen for x in v] == values.tolist()
    (request,) = step.train_requests(0)
    assert request.shard.advantages is not None and request.shard.advantages.tolist() == (2 * values).tolist()
    # The critic trains towards the hook's returns, as slime's critic (which calls it too).
    work = CriticWork.build(batch_samples, algo, WorkOptions(global_batch_size=4), dp_size=1, hooks=hooks)
    assert len(work.value_requests()) == 1
    work.with_values([values])  # one DP rank holding every sample in order
    assert work.batch.returns is not None and work.batch.returns.tolist() == values.tolist()
