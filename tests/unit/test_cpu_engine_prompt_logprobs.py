"""The CPU engine scores prompts as SGLang does: /generate with `return_logprob` and
`logprob_start_len` K returns `meta_info.input_token_logprobs` (one [logprob, id, text] entry per
prompt token from K, the first without a log-prob) and `input_top_logprobs`, equal to transformers'
log-softmax of the prompt; `max_new_tokens` 0 scores without generating. The engine's HTTP app
runs in this process (aiohttp's test server on loopback); no process is started."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from support.cpu_engine_app import host_scheduler
from support.engines import hf_logprobs

from tether.rollout.cpu_engine.http.common import EngineState
from tether.rollout.cpu_engine.http.sglang_api import make_app
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.rollout.cpu_engine.prompt_logprobs import score_prompt

PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]
TOL = 1e-5  # fp32, the same torch ops as transformers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=3)))


class Client:
    """POSTs to an in-process CPU engine app (no key: it serves without authentication)."""

    def __init__(self, model_dir: str) -> None:
        sched = host_scheduler(model_dir, context_length=256, max_running=8)
        self.tokenizer = sched.tokenizer
        state = EngineState(scheduler=sched, model_path=model_dir, host="127.0.0.1", port=0)
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(make_app(state)), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())

    def post(self, payload: dict[str, Any]) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            resp = await self.client.post("/generate", json=payload)
            return resp.status, await resp.json()

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[Client]:
    client = Client(model_dir)
    try:
        yield client
    finally:
        client.close()


def _ref(model_dir: str, ids: list[int]) -> list[float]:
    """transformers' log-prob of each token of `ids` after the first, given those before it."""
    full = hf_logprobs(model_dir, ids)
    return [float(full[i - 1, tok]) for i, tok in enumerate(ids) if i > 0]


def test_scoring_request_as_slime_sends_it(engine: Client, model_dir: str) -> None:
    # slime.rollout.on_policy_distillation.reward_func's payload, verbatim in shape
    status, out = engine.post(
        {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
    )
    assert status == 200, out
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT and all(e[2] is None for e in entries)
    assert entries[0][0] is None  # nothing precedes the first token
    ref = _ref(model_dir, PROMPT)  # raw log_softmax: the temperature does not touch input log-probs
    assert max(abs(e[0] - r) for e, r in zip(entries[1:], ref, strict=True)) < TOL
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(PROMPT)
    assert "input_top_logprobs" not in meta  # only with top_logprobs_num


def test_start_inside_prompt_with_generation_top_and_text(engine: Client, model_dir: str) -> None:
    k = 3
    status, out = engine.post(
        {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": k,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        }
    )
    assert status == 200, out
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT[k:]
    # SGLang's shape: the entry of token K has no log-prob even though K > 0
    assert entries[0][0] is None
    ref = _ref(model_dir, PROMPT)[k:]  # tokens K+1 .. L-1
    assert max(abs(e[0] - r) for e, r in zip(entries[1:], ref, strict=True)) < TOL
    text = lambda t: engine.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    assert [e[2] for e in entries] == [text(t) for t in PROMPT[k:]]
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(entries) and tops[0] is None
    full = hf_logprobs(model_dir, PROMPT)
    for j, row in enumerate(tops[1:]):
        best = full[k + j].topk(2)
        assert [t[1] for t in row] == best.indices.tolist()
        assert max(abs(t[0] - float(v)) for t, v in zip(row, best.values, strict=True)) < TOL
        assert all(t[2] == text(t[1]) for t in row)
    # the output's own entries are unchanged in meaning and carry text too
    outs = meta["output_token_logprobs"]
    assert [e[1] for e in outs] == out["output_ids"] and len(outs) == 4
    assert all(e[2] == text(e[1]) for e in outs)
    assert len(meta["output_top_logprobs"]) == 4
    ids = PROMPT + out["output_ids"]
    gen_ref = _ref(model_dir, ids)[len(PROMPT) - 1 :]
    assert max(abs(e[0] - r) for e, r in zip(outs, gen_ref, strict=True)) < TOL


def test_per_item_starts_and_defaults(engine: Client, model_dir: str) -> None:
    other = [9, 8, 7, 6, 5]
    status, out = engine.post(
        {
            "input_ids": [PROMPT, other, other],
            "sampling_params": {"temperature": 0, "max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": [1, -1, len(other)],
        }
    )
    assert status == 200, out
    first, default, at_end = (o["meta_info"]["input_token_logprobs"] for o in out)
    assert [e[1] for e in first] == PROMPT[1:] and first[0][0] is None
    assert max(abs(e[0] - r) for e, r in zip(first[1:], _ref(model_dir, PROMPT)[1:], strict=True)) < TOL
    assert default == [] and at_end == []  # -1 (output tokens only) and K == L score nothing
    # a plain generation request reports an empty prompt list beside its output, as SGLang does
    status, out = engine.post(
        {
            "input_ids": other,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True,
        }
    )
    assert status == 200 and out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 2


@pytest.mark.parametrize(
    ("start", "words"),
    [
        (len(PROMPT) + 1, "is higher than the number of input tokens"),
        (-2, "must be -1"),
        ("zero", "invalid field"),
        ([0, 0], "has 2 entries for 1 prompts"),
    ],
)
def test_bad_start_is_refused_naming_the_field(engine: Client, start: Any, words: str) -> None:
    status, body = engine.post({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start})
    message = body["error"]["message"]
    assert status == 400 and "logprob_start_len" in message and words in message, message


def test_start_is_ignored_without_return_logprob(engine: Client) -> None:
    # SGLang resets logprob_start_len to -1 when no log-probs are asked for
    status, out = engine.post(
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "logprob_start_len": 99}
    )
    assert status == 200 and "input_token_logprobs" not in out["meta_info"]


def test_score_prompt_shapes_rows() -> None:
    logits = torch.randn(4, 10)
    got = score_prompt([1, 2, 3, 4, 5, 6], 2, logits, top_k=3)
    lp = torch.log_softmax(logits, dim=-1)
    assert got.token_ids == [3, 4, 5, 6]
    assert got.logprobs[0] is None
    assert got.logprobs[1:] == pytest.approx([float(lp[0, 4]), float(lp[1, 5]), float(lp[2, 6])])
    assert got.top is not None and got.top[0] is None and len(got.top) == 4
    one = score_prompt([7], 0, torch.randn(1, 10), top_k=0)
    assert one.logprobs == [None] and one.token_ids == [7] and one.top is None


@pytest.mark.parametrize(
    ("argv", "env_key", "words"),
    [
        (["--host", "0.0.0.0"], None, "not a loopback address"),
        (["--host", "127.0.0.1", "--api-key-file", "/k"], None, "a key was given too"),
        (["--host", "127.0.0.1"], "k" * 32, "a key was given too"),
    ],
)
def test_no_api_key_is_loopback_only_and_alone(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env_key: str | None, words: str
) -> None:
    """An open teacher server (--no-api-key) is refused unless nothing but this machine reaches it."""
    import argparse

    from tether.rollout.cpu_engine import server
    from tether.rollout.engine_api.auth import ENGINE_KEY_ENV
    from tether.runtime.errors import ConfigError

    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--model-path", "/m", "--no-api-key", *argv])
    if env_key is None:
        monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_KEY_ENV, env_key)
    with pytest.raises(ConfigError) as err:
        server._api_key(args)
    assert err.value.key == "--no-api-key" and words in str(err.value)
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    open_args = parser.parse_args(["--model-path", "/m", "--no-api-key", "--host", "127.0.0.1"])
    assert server._api_key(open_args) is None
