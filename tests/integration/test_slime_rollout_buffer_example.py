"""slime's slime_plugins/rollout_buffer/rollout_buffer_example.py, unchanged, as a --rollout-function-path
on tether's args against the stand-in rollout buffer, beside tether's own buffer rollout function:
both start the buffer with the same payload and make the same tokens, loss masks, rewards and
statuses from the same trajectories. The file is read from slime's source (git show; skipped where
it is not at hand), never copied into this tree. Starts `git` only; slime's example sleeps 5 s
before each fetch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support.rollout_buffer import StandIn, group, ready, serving_in_thread, trajectory
from support.slime_source import slime_file

from tether.config import resolve
from tether.rollout.data.source import DataSource, PromptRecord, load_tokenizer
from tether.rollout.hooks.calls import load_function
from tether.rollout.hooks.rollout_buffer import generate_rollout
from tether.rollout.rollout_fn import RolloutContext, using_context
from tether.rollout.routing.router import Router
from tether.rollout.slime_api import finder
from tether.rollout.slime_api.args import slime_args
from tether.rollout.slime_api.bridge import call_rollout_function
from tether.rollout.slime_api.convert import from_slime, uses_slime_api


@pytest.mark.timeout(120)
def test_slimes_buffer_example_and_tethers_function_agree(tmp_path: Path, tiny_model: Path) -> None:
    pytest.importorskip("wandb")  # slime's example imports it
    example = slime_file(
        "slime_plugins/rollout_buffer/rollout_buffer_example.py", tmp_path / "rollout_buffer_example.py"
    )
    path = f"{example}:generate_rollout"
    slimes = load_function(path, "--rollout-function-path")
    assert uses_slime_api(slimes)
    meta = {"total_samples": 4, "avg_reward": 0.75, "finished_groups": []}
    answer = ready(
        *group(7), trajectory(9, 0, reward=0.0), trajectory(9, 1, finish_reason="length"), meta=meta
    )
    stand_in = StandIn([answer])

    async def scenario() -> tuple[list[Any], list[Any]]:
        with serving_in_thread(stand_in):  # slime's example blocks the loop it runs on
            argv = ["--rollout-buffer-url", stand_in.url, "--hf-checkpoint", str(tiny_model)]
            argv += [
                "--rollout-batch-size",
                "2",
                "--n-samples-per-prompt",
                "2",
                "--rollout-max-response-len",
                "64",
            ]
            argv += ["--prompt-data", "prompts.jsonl", "--rollout-task-type", "code"]
            cfg = resolve(["--rollout-function-path", path, *argv])
            extra = slime_args(cfg, router_ip="127.0.0.1", router_port=4321)
            tokenizer = await asyncio.to_thread(load_tokenizer, str(tiny_model))
            data = DataSource([PromptRecord(prompt="p", tokens=[1])], n_samples_per_prompt=2)
            async with RolloutContext(cfg, Router(), tokenizer=tokenizer, args_extra=extra) as ctx:
                with using_context(ctx):
                    theirs = await call_rollout_function(slimes, ctx, 0, data, path=path)
                    ours = await generate_rollout(ctx.args, 0, data)
            return theirs, ours

    try:
        theirs, ours = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        finder.uninstall()
    # the same start payload: tether's function sends what slime's example sends
    assert len(stand_in.starts) == 2 and stand_in.starts[0] == stand_in.starts[1]
    assert stand_in.starts[0]["task_type"] == "code"
    assert stand_in.starts[0]["remote_engine_url"] == "http://127.0.0.1:4321"
    assert [len(g) for g in theirs] == [len(g) for g in ours] == [2, 2]
    for slime_group, our_group in zip(theirs, ours, strict=True):
        for slime_sample, our in zip(slime_group, our_group, strict=True):
            s = from_slime(slime_sample)
            assert (s.tokens, s.response_length, s.loss_mask) == (
                our.tokens,
                our.response_length,
                our.loss_mask,
            )
            assert (s.reward, s.status, s.prompt) == (our.reward, our.status, our.prompt)
            assert s.metadata.items() <= our.metadata.items()
            # slime's example numbers its samples by instance_id; tether's numbers them in order
            assert s.index == our.metadata["instance_id"]
    assert ours[1][1].status.value == "truncated" and sum(ours[0][0].loss_mask) > 0
