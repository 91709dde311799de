"""tether's agent entry trains an agent written with the OpenAI Agents SDK (`openai-agents`, two
function tools) for one step on CPU: a real `tether run` (the tiny model, one CPU engine, one
trainer rank) whose every sample is one agent run against the OpenAI adapter.

What it shows: each agent run called a tool and became exactly one sample (the SDK's echo of its
own history continues the recorded tokens, no spurious branch); the tool results are in the
sample under loss mask 0 and log-prob 0; the reward hook scored the agent's output; and every
trained token is one the engine generated, in the context it generated it in: a fresh engine on
the same weights, scoring each whole sample, gives the engine's own log-prob on every token of
the free turns, and the trainer's log-probs are that engine's on every trained token (its mean
difference to the rollout's log-probs is what the fresh engine's predicts). The first turn is a
forced tool call: its tokens were sampled under the tool grammar, so their rollout log-probs are
the constrained distribution's (as SGLang reports them) and differ from the model's own."""

from __future__ import annotations

import json
import math
import sys
import urllib.request
from pathlib import Path

import pytest
from support.e2e import Workspace, check_clean_exit, jsonl, tether
from support.engines import ENGINE_KEY, Engine, start_cpu_engine, stop_engine
from transformers import AutoTokenizer

from tether.rollout.debug_dump import load_rollout

AGENTS = Path(__file__).resolve().parents[1] / "support" / "agents"
AGENT = AGENTS / "openai_agents_weather.py"
GROUPS, SAMPLES = 2, 2


def test_an_openai_agents_program_trains_one_step_through_the_agent_entry(
    ws: Workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("agents")
    log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("TETHER_TEST_AGENT_LOG", str(log))
    run, dump = _train_one_step(
        ws,
        tmp_path,
        groups=GROUPS,
        samples=SAMPLES,
        response_len=96,
        agent=("--agent-function-path", f"{AGENT}:agent", "--custom-rm-path", f"{AGENT}:reward"),
        extra=("--calculate-per-token-loss",),  # the mismatch metric is then a mean over trained tokens
    )
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m["step"] >= 0]
    assert [m["step"] for m in metrics] == [0]
    (m,) = metrics
    assert math.isfinite(m["train/loss"])
    assert m["rollout/samples"] == GROUPS * SAMPLES  # one sample per agent run: no spurious fork
    check_clean_exit(run)

    events = jsonl(log)
    calls = [e for e in events if "tool" in e]
    scored = [e["reward_response"] for e in events if "reward_response" in e]
    assert len(calls) >= GROUPS * SAMPLES and {c["tool"] for c in calls} <= {"get_weather", "get_population"}
    assert len(scored) == GROUPS * SAMPLES

    tokenizer = AutoTokenizer.from_pretrained(str(ws.model))
    samples = [s for g in load_rollout(dump, 0).groups for s in g]
    assert len(samples) == GROUPS * SAMPLES
    assert sorted(s.metadata["agent_output"] for s in samples) == sorted(scored)
    for s in samples:
        assert s.metadata["agent_exit_code"] == 0 and s.metadata["use_tool"], s.metadata
        mask, logps = s.loss_mask, s.rollout_log_probs
        assert mask is not None and logps is not None and len(mask) == s.response_length
        response = s.tokens[len(s.tokens) - s.response_length :]
        assert any(mask) and not all(mask)  # the model's turns train, the tool's do not
        assert all(lp == 0.0 for lp, keep in zip(logps, mask, strict=True) if not keep)
        assert all(lp <= 0.0 for lp, keep in zip(logps, mask, strict=True) if keep)  # 0: grammar-forced
        untrained = tokenizer.decode([t for t, keep in zip(response, mask, strict=True) if not keep])
        trained = tokenizer.decode([t for t, keep in zip(response, mask, strict=True) if keep])
        assert "-RESULT" in untrained and "-RESULT" not in trained  # tool results under mask 0
        assert json.dumps(s.metadata).find("TETHER_ENGINE_API_KEY") < 0

    # The engine's own scoring of each whole sample, with the weights the rollout ran on.
    engine = start_cpu_engine(ws.model, tmp_path)
    try:
        scored_logps = [
            _input_logprobs(engine, s.tokens)[len(s.tokens) - s.response_length :] for s in samples
        ]
    finally:
        stop_engine(engine)
    diffs: list[float] = []
    for s, model_logps in zip(samples, scored_logps, strict=True):
        assert s.loss_mask is not None and s.rollout_log_probs is not None
        turns = _trained_turns(s.loss_mask)
        assert len(turns) >= 2, turns  # the forced tool call, then the answer after the tool result
        forced, free = turns[0], [i for turn in turns[1:] for i in turn]
        for i in free:  # sampled freely: the rollout's log-prob is the model's, context and all
            assert abs(model_logps[i] - s.rollout_log_probs[i]) < 1e-4, (
                i,
                model_logps[i],
                s.rollout_log_probs[i],
            )
        for i in forced:  # renormalised over the tokens the grammar allowed: never less likely
            assert s.rollout_log_probs[i] >= model_logps[i] - 1e-4
        diffs += [abs(model_logps[i] - s.rollout_log_probs[i]) for turn in turns for i in turn]
    # The trainer's log-probs on the trained tokens are the engine's: the same mean difference.
    assert abs(m["train/train_rollout_logprob_abs_diff"] - sum(diffs) / len(diffs)) < 1e-3


def test_a_command_agent_on_the_anthropic_sdk_trains_through_the_agent_entry(
    ws: Workspace, tmp_path: Path
) -> None:
    """The same entry with --agent-command and --agent-api anthropic: the command's stdout is the
    agent's output, the reward hook scores it, the tool result trains nothing."""
    run, dump = _train_one_step(
        ws,
        tmp_path,
        groups=1,
        samples=2,
        response_len=64,
        agent=(
            "--agent-command",
            f"{sys.executable} {AGENTS / 'anthropic_command.py'}",
            "--agent-api",
            "anthropic",
        ),
    )
    check_clean_exit(run)
    tokenizer = AutoTokenizer.from_pretrained(str(ws.model))
    samples = [s for g in load_rollout(dump, 0).groups for s in g]
    assert len(samples) == 2
    for s in samples:
        assert s.metadata["agent_exit_code"] == 0 and "agent_error" not in s.metadata, s.metadata
        assert s.metadata["use_tool"] and isinstance(s.metadata["agent_output"], str)
        assert s.loss_mask is not None
        response = s.tokens[len(s.tokens) - s.response_length :]
        untrained = tokenizer.decode([t for t, keep in zip(response, s.loss_mask, strict=True) if not keep])
        assert "WEATHER-RESULT" in untrained and len(_trained_turns(s.loss_mask)) == 2


def _train_one_step(
    ws: Workspace,
    tmp_path: Path,
    *,
    groups: int,
    samples: int,
    response_len: int,
    agent: tuple[str, ...],
    extra: tuple[str, ...] = (),
) -> tuple[Path, Path]:
    """One `tether run` step through the agent entry: its run directory and rollout dump."""
    run, dump = tmp_path / "run", tmp_path / "dump_{rollout_id}.msgpack"
    tether(
        "run",
        *ws.flags(
            run,
            "--num-rollout",
            "1",
            "--rollout-batch-size",
            str(groups),
            "--n-samples-per-prompt",
            str(samples),
            "--cpu-devices",
            "2",
            "--actor-num-gpus-per-node",
            "1",
            "--rollout-max-response-len",
            str(response_len),
            "--custom-generate-function-path",
            "tether.rollout.agents.generate",
            *agent,
            "--sglang-tool-call-parser",
            "qwen25",
            "--save-debug-rollout-data",
            str(dump),
            *extra,
        ),
    )
    return run, dump


def _trained_turns(mask: list[int]) -> list[list[int]]:
    """The positions of each run of loss-mask 1 (one generated turn each)."""
    turns: list[list[int]] = []
    for i, keep in enumerate(mask):
        if keep:
            if i == 0 or not mask[i - 1]:
                turns.append([])
            turns[-1].append(i)
    return turns


def _input_logprobs(engine: Engine, tokens: list[int]) -> list[float]:
    """The engine's log-prob of each of `tokens` given those before it (0 for the first)."""
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    request = urllib.request.Request(
        f"{engine.url}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ENGINE_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        meta = json.loads(reply.read())["meta_info"]
    return [float(lp) if lp is not None else 0.0 for lp, _tok, _text in meta["input_token_logprobs"]]
