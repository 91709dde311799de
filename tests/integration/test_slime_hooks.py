"""Hook files written in slime's API drive short `tether run`s on the CPU engine, unchanged.

Two runs of two steps each (the tiny model, one engine, one trainer rank):

* tool turns: a custom generate that calls a tool between two turns through the router front
  (`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`), a slime-style reward, a
  `check_reward_nonzero_std` dynamic filter and a buffer filter over partial rollouts. The dumped
  rollouts show the tool's tokens under loss mask 0 (log-prob 0), the model's under 1, and the
  trainer's log-probs match the engine's on what trained.
* rollout function: a synchronous slime rollout function (data source, `run`,
  `generate_and_rm_group`, the group reward of --group-rm) returning slime Samples in both
  shapes, `RolloutFnTrainOutput` and the bare list. Its prompts come from a slime data source
  class (--data-source-path: built with args, loaded before the first rollout, saved at the
  checkpoint), its training data from slime's two train-data hooks
  (--custom-convert-samples-to-train-data-path masks each response's first token,
  --rollout-data-postprocess-path its last: the train dump shows both), and
  --log-correct-samples logs the group winners.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from support.e2e import Workspace, check_clean_exit, jsonl, tether

from tether.rollout.debug_dump import load_rollout
from tether.rollout.slime_api.convert import SLIME_ATTRS
from tether.run.train_dump import load_train_data

HOOKS = Path(__file__).resolve().parents[1] / "support" / "slime_hooks"
STEPS = 2
GROUPS = 2  # per rollout
SAMPLES = 4  # per group


def _flags(ws: Workspace, run: Path, *extra: str) -> list[str]:
    return ws.flags(
        run,
        "--num-rollout",
        str(STEPS),
        "--rollout-batch-size",
        str(GROUPS),
        "--n-samples-per-prompt",
        str(SAMPLES),
        "--cpu-devices",
        "2",
        "--actor-num-gpus-per-node",
        "1",
        "--update-weight-transport",
        "disk",
        "--update-weight-disk-dir",
        str(run.parent / "weights"),
        *extra,
    )


def _check_trained(run: Path) -> list[dict]:
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m["step"] >= 0]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert math.isfinite(m["train/loss"]) and m["rollout/samples"] == GROUPS * SAMPLES
    check_clean_exit(run)
    return metrics


def test_tool_turns_reward_and_filters_in_slime_api(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "hooks.jsonl"
    monkeypatch.setenv("TETHER_TEST_HOOK_LOG", str(log))
    run = tmp_path / "run"
    hooks = HOOKS / "tool_turns.py"
    tether(
        "run",
        *_flags(
            ws,
            run,
            "--custom-generate-function-path",
            f"{hooks}:generate",
            "--custom-rm-path",
            f"{hooks}:reward_func",
            "--dynamic-sampling-filter-path",
            f"{hooks}:keep_spread",
            "--buffer-filter-path",
            f"{hooks}:newest_first",
            "--over-sampling-batch-size",
            "6",
            "--partial-rollout",
            "--save-debug-rollout-data",
            str(tmp_path / "dump_{rollout_id}.msgpack"),
            "--check-weight-update-equal",
        ),
    )
    metrics = _check_trained(run)
    # --check-weight-update-equal: the engine snapshotted its weights, took noise, received the
    # trainer's before the first rollout and compared them equal (a mismatch fails the run).
    checks = [e for e in jsonl(run / "events.jsonl") if e["event"] == "weight_update_equal"]
    assert len(checks) == 1, checks
    events = jsonl(log)
    kinds = {e["event"] for e in events}
    assert kinds == {"generate", "reward", "filter", "buffer_filter"}, kinds
    # the surplus of rollout 0 (over-sampling 6 groups for 2) waited in the buffer for rollout 1
    assert any(e["event"] == "buffer_filter" and e["taken"] > 0 and e["slime_samples"] for e in events)
    assert all(e["router_port"] > 0 for e in events if e["event"] == "generate")
    for step in range(STEPS):
        dump = load_rollout(tmp_path / "dump_{rollout_id}.msgpack", step)
        for sample in [s for g in dump.groups for s in g]:
            mask, logps = sample.loss_mask, sample.rollout_log_probs
            assert mask is not None and logps is not None
            [(start, end)] = sample.metadata["tool_spans"]
            tool = range(start, end)
            assert end > start and all(mask[i] == 0 and logps[i] == 0.0 for i in tool)
            assert all(mask[i] == 1 for i in range(sample.response_length) if i not in tool)
            assert sample.metadata[SLIME_ATTRS] == {"tool_calls": 1}
    # What trained has the engine's log-probs: the tool tokens were not trained as the model's.
    fresh = [m for m in metrics if m["rollout/version_lag_max"] == 0]
    assert fresh and all(m["train/train_rollout_logprob_abs_diff"] < 1e-4 for m in fresh)


def test_rollout_function_in_slime_api(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "hooks.jsonl"
    monkeypatch.setenv("TETHER_TEST_HOOK_LOG", str(log))
    run = tmp_path / "run"
    hooks = HOOKS / "rollout_function.py"
    train_data = HOOKS / "train_data.py"
    tether(
        "run",
        *_flags(
            ws,
            run,
            "--rollout-function-path",
            f"{hooks}:generate_rollout",
            "--custom-rm-path",
            f"{hooks}:group_reward",
            "--group-rm",
            "--data-source-path",
            f"{HOOKS / 'data_source.py'}:PromptSource",
            "--custom-convert-samples-to-train-data-path",
            f"{train_data}:convert",
            "--rollout-data-postprocess-path",
            f"{train_data}:postprocess",
            "--log-correct-samples",
            "--save",
            str(tmp_path / "ckpt"),
            "--save-debug-train-data",
            str(tmp_path / "train_{rollout_id}.msgpack"),
        ),
    )
    metrics = _check_trained(run)
    assert metrics[0]["custom/groups"] == GROUPS  # RolloutFnTrainOutput's metrics reach the record
    events = jsonl(log)
    rollouts = [e for e in events if e["event"] == "rollout"]
    assert [e["rollout_id"] for e in rollouts] == list(range(STEPS))
    assert all(e["groups"] == GROUPS and set(e["statuses"]) <= {"completed", "truncated"} for e in rollouts)
    assert sum(e["event"] == "group_reward" for e in events) == STEPS * GROUPS
    assert all(m["train/grad_norm"] > 0 for m in metrics)  # the group rewards have spread
    # --data-source-path: built once, load(start_rollout_id - 1) before the first draw, save at the checkpoint
    source = [e for e in events if e["event"].startswith("source_")]
    assert [e["event"] for e in source[:2]] == ["source_init", "source_load"] and source[1][
        "rollout_id"
    ] == -1
    assert events.index(source[1]) < events.index(rollouts[0])
    saves = [e for e in source if e["event"] == "source_save"]
    assert saves == [{"event": "source_save", "rollout_id": STEPS - 1, "offset": STEPS * GROUPS}]
    assert (tmp_path / "ckpt" / "rollout" / f"prompt_source_{STEPS - 1}.json").is_file()
    # the converter and the postprocess hook: once per step; their masks are what trained
    assert [e["samples"] for e in events if e["event"] == "convert"] == [GROUPS * SAMPLES] * STEPS
    post = [e for e in events if e["event"] == "postprocess"]
    assert [e["rollout_id"] for e in post] == list(range(STEPS))
    assert {"advantages", "loss_masks", "tokens", "raw_reward", "partition"} <= set(post[0]["keys"])
    # one DP rank: slime's `partition` is every sample's own position in the rollout
    assert all(e["partition"] == list(range(e["samples"])) for e in post)
    for step in range(STEPS):
        [[shard]] = load_train_data(tmp_path / f"train_{step}.msgpack").steps
        lengths = shard["response_lengths"].tolist()
        ends = list(itertools.accumulate(lengths))
        starts = [e - n for e, n in zip(ends, lengths, strict=True)]
        masks = shard["loss_masks"].tolist()
        assert all(masks[a] == 0 and masks[b - 1] == 0 for a, b in zip(starts, ends, strict=True))
        assert all(masks[a + 1 : b - 1] == [1] * (b - a - 2) for a, b in zip(starts, ends, strict=True))
    # --log-correct-samples: one winner (group reward 1) per group, binned by response length
    for m in metrics:
        assert m["rollout/correct_samples"] == GROUPS
        bins = [m[f"rollout/correct_length/p{p}"] for p in (25, 50, 75, 100)]
        assert sum(bins) == pytest.approx(1.0)
