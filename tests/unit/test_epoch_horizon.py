"""--num-epoch without --num-rollout (slime's SFT scripts): the run counts --num-rollout from the
prompts before the trainer starts, as slime's `create_rollout_manager` does
(`len(data_source) // rollout_batch_size * num_epoch`), and --train-iters, the LR decay horizon
and a --lr-warmup-fraction follow from it as slime's `initialize_model_and_optimizer` derives them
(`num_rollout * rollout_batch_size * n_samples_per_prompt // global_batch_size`)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from tether.config import check_epoch_source, counts_epochs, horizon_note, resolve, with_counted_epochs
from tether.rollout.data.source import DataSource
from tether.run.job import prompt_count, total_rollouts
from tether.runtime.errors import ConfigError
from tether.train.model import megatron_args

SFT = ["--num-epoch", "3", "--lr-decay-style", "cosine", "--min-lr", "1e-6", "--lr-warmup-fraction", "0.1"]


def counted(argv: list[str], prompts: int) -> Any:
    cfg = resolve(argv)
    assert counts_epochs(cfg) and cfg.data.num_rollout is None  # nothing counted at parse time
    return with_counted_epochs(cfg, prompts)


def test_the_count_is_whole_batches_per_epoch_times_epochs() -> None:
    # 10 prompts in batches of 4: 2 whole batches an epoch (the 2 left over are not a rollout),
    # 3 epochs: 6 rollouts; one optimizer step each (global batch = the rollout's 4 samples).
    assert resolve([*SFT, "--rollout-batch-size", "4"]).megatron.train_iters is None
    cfg = counted([*SFT, "--rollout-batch-size", "4"], prompts=10)
    assert cfg.data.num_rollout == 6
    assert cfg.megatron.train_iters == 6
    assert not counts_epochs(cfg)


@pytest.mark.parametrize(
    ("extra", "steps_per_rollout"),
    [
        # 4 prompts x 2 samples = 8 samples a rollout, --global-batch-size 4: 2 steps a rollout.
        (["--n-samples-per-prompt", "2", "--global-batch-size", "4"], 2),
        # --num-steps-per-rollout 4 of the 8 samples: a global batch of 2, 4 steps a rollout.
        (["--n-samples-per-prompt", "2", "--num-steps-per-rollout", "4"], 4),
        # The whole 8-sample rollout as one step.
        (["--n-samples-per-prompt", "2", "--global-batch-size", "8"], 1),
    ],
)
def test_train_iters_follow_the_counted_rollouts_as_slime_derives_them(
    extra: list[str], steps_per_rollout: int
) -> None:
    cfg = counted([*SFT, "--rollout-batch-size", "4", *extra], prompts=21)
    assert cfg.data.num_rollout == 15  # 21 // 4 = 5 a epoch, x 3
    data = cfg.data
    slime = (
        data.num_rollout
        * data.rollout_batch_size
        * data.n_samples_per_prompt
        // data.resolved_global_batch_size
    )
    assert cfg.megatron.train_iters == slime == 15 * steps_per_rollout


def test_the_schedule_decays_over_the_counted_horizon_with_its_warmup_fraction() -> None:
    cfg = counted([*SFT, "--rollout-batch-size", "4", "--lr", "1e-5"], prompts=40)  # 10 x 3 = 30 steps
    kwargs = megatron_args.scheduler_kwargs(cfg.megatron, cfg.algorithm)
    assert kwargs["lr_decay_steps"] == 30 and kwargs["wd_incr_steps"] == 30
    assert kwargs["lr_warmup_steps"] == pytest.approx(3.0)  # 0.1 of the 30-step horizon
    assert (kwargs["lr_decay_style"], kwargs["min_lr"], kwargs["max_lr"]) == ("cosine", 1e-6, 1e-5)


def test_a_given_decay_or_train_horizon_is_kept() -> None:
    cfg = counted([*SFT, "--rollout-batch-size", "4", "--lr-decay-iters", "50"], prompts=40)
    assert cfg.data.num_rollout == 30 and cfg.megatron.train_iters == 30
    assert cfg.megatron.lr_decay_horizon == 50
    cfg = counted([*SFT, "--rollout-batch-size", "4", "--train-iters", "7"], prompts=40)
    assert cfg.data.num_rollout == 30 and cfg.megatron.train_iters == 7


def test_num_rollout_wins_over_num_epoch_as_in_slime() -> None:
    cfg = resolve([*SFT, "--num-rollout", "5", "--rollout-batch-size", "4"])
    assert not counts_epochs(cfg) and cfg.megatron.train_iters == 5
    assert with_counted_epochs(cfg, 1000) is cfg
    assert horizon_note(cfg) is None


def test_too_few_prompts_for_one_batch_are_refused_naming_num_epoch() -> None:
    with pytest.raises(ConfigError) as err:
        counted([*SFT, "--rollout-batch-size", "4"], prompts=3)
    assert err.value.key == "--num-epoch" and "3 prompts" in str(err.value)


def test_the_plan_says_the_horizon_is_counted_at_start() -> None:
    note = horizon_note(resolve([*SFT, "--rollout-batch-size", "128"]))
    assert note is not None and "--num-epoch 3" in note and "when the run starts" in note
    assert "--rollout-batch-size 128" in note


class _Prompts(DataSource):
    """A loaded data source of `n` prompts (what the run counts), without a prompt file."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Manager:
    def __init__(self, data: DataSource) -> None:
        self.data = data


def test_the_loop_runs_the_counted_rollouts() -> None:
    cfg = resolve([*SFT, "--rollout-batch-size", "4"])
    # slime's (10 // 4) x 3 = 6, not 3 x 10 // 4 = 7.
    assert total_rollouts(cfg, _Manager(_Prompts(10))) == 6  # type: ignore[arg-type]
    assert total_rollouts(with_counted_epochs(cfg, 10), _Manager(_Prompts(99))) == 6  # type: ignore[arg-type]


class _Unsized(DataSource):
    def __init__(self) -> None:
        pass

    def __len__(self) -> int:
        raise TypeError("the stream has no length")


def test_a_data_source_without_a_usable_length_is_refused_naming_the_flag() -> None:
    cfg = resolve([*SFT, "--rollout-batch-size", "4"])
    with pytest.raises(ConfigError) as err:
        prompt_count(_Unsized(), cfg)
    assert err.value.key == "--data-source-path" and "--num-rollout" in str(err.value)


def test_plan_refuses_a_counted_data_source_class_without_len(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_sources.py").write_text(
        textwrap.dedent(
            """
            class Stream:
                def __init__(self, args): pass
                def get_samples(self, n): return []
                def add_samples(self, groups): pass
                def save(self, rollout_id): pass
                def load(self, rollout_id=None): pass

            class Sized(Stream):
                def __len__(self): return 8
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = [*SFT, "--rollout-batch-size", "4"]
    check_epoch_source(resolve([*base, "--data-source-path", "my_sources.Sized"]))
    with pytest.raises(ConfigError) as err:
        check_epoch_source(resolve([*base, "--data-source-path", "my_sources.Stream"]))
    assert err.value.key == "--data-source-path" and "__len__" in str(err.value)
    # With --num-rollout nothing is counted, so the class is checked where every hook is.
    check_epoch_source(resolve([*base, "--num-rollout", "2", "--data-source-path", "my_sources.Stream"]))
