"""The CPU engine's parts in this process: init-model, the pure-torch forward against
transformers for each family, sampling, and tensor payloads (the weight-update process group
between two processes is tests/integration/test_runtime_weight_group.py)."""

from __future__ import annotations

import argparse
import base64
import json
import pickle
from pathlib import Path

import pytest
import torch

from tether.rollout.cpu_engine.modeling import tiny_model
from tether.rollout.cpu_engine.modeling.model import (
    KVCache,
    ModelConfig,
    TinyLM,
    WeightMismatch,
    read_safetensors_dir,
)
from tether.rollout.cpu_engine.sampling import SamplingParams, choose_tokens, parse_sampling_params
from tether.rollout.engine_api.weights import PayloadRejected, decode_named_tensors, encode_named_tensors
from tether.runtime.errors import ConfigError


def _write(tmp: Path, *flags: str) -> Path:
    parser = argparse.ArgumentParser()
    tiny_model.add_arguments(parser)
    assert tiny_model.main(parser.parse_args(["--out", str(tmp), *flags])) == 0
    return tmp


@pytest.mark.parametrize(
    ("arch", "flags"),
    [("llama", ()), ("qwen2", ()), ("qwen3", ("--tie-embeddings",))],
)
def test_init_model_loads_in_transformers_and_engine_forward_matches(
    tmp_path: Path, arch: str, flags: tuple[str, ...]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _write(tmp_path / arch, "--arch", arch, *flags)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["vocab_size"] == 320
    tok = AutoTokenizer.from_pretrained(out)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = ModelConfig.from_dir(out)
    model, cache = TinyLM(cfg, read_safetensors_dir(out)), KVCache(cfg)
    prompts = [[1, 5, 6, 7, 8], [9, 3]]
    slots = [cache.allocate(16) for _ in prompts]
    with torch.inference_mode():
        logits = model.prefill(prompts, slots, cache)
        nxt = logits.argmax(-1).tolist()
        step = model.decode(nxt, [len(p) for p in prompts], slots, cache)
        for row, prompt in enumerate(prompts):
            ref = hf(torch.tensor([[*prompt, nxt[row]]])).logits[0]
            assert torch.allclose(logits[row], ref[-2], atol=1e-5)
            assert torch.allclose(step[row], ref[-1], atol=1e-5)


def test_init_model_sparse_attention_flags(tmp_path: Path) -> None:
    """--index-topk and --index-topk-freq shape GLM-5's indexers as transformers reads them (layers
    1 and 2 sharing layer 0's top-k at freq 3, layer 4 layer 3's), and the engine's prefill equals transformers' on
    them; the flags are refused where they mean nothing."""
    from transformers import AutoModelForCausalLM

    out = _write(
        tmp_path / "glm5",
        "--arch",
        "glm_moe_dsa",
        "--layers",
        "5",
        "--index-topk",
        "3",
        "--index-topk-freq",
        "3",
    )
    config = json.loads((out / "config.json").read_text())
    assert config["index_topk"] == 3 and config["index_n_heads"] == tiny_model.TINY_INDEX_HEADS
    assert config["indexer_types"] == ["full", "shared", "shared", "full", "shared"]
    cfg = ModelConfig.from_dir(out)
    assert cfg.dsa is not None and cfg.dsa.full_layers == (True, False, False, True, False)
    model, cache = TinyLM(cfg, read_safetensors_dir(out)), KVCache(cfg)
    seq = list(range(40, 54))
    scores: dict[int, torch.Tensor] = {}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        model.prefill([seq], [cache.allocate(16)], cache, score_from={0: 0}, scores=scores)
        ref = hf(torch.tensor([seq])).logits[0]
    assert torch.allclose(scores[0], ref, atol=1e-5), float((scores[0] - ref).abs().max())
    with pytest.raises(ConfigError, match="--index-topk-freq=2: only glm_moe_dsa"):
        tiny_model.TinyModelSpec(arch="deepseek_v32", index_topk_freq=2)
    with pytest.raises(ConfigError, match="--index-topk=0"):
        tiny_model.TinyModelSpec(arch="deepseek_v32", index_topk=0)
    with pytest.raises(ConfigError, match="--mtp-layers=1: only"):
        tiny_model.TinyModelSpec(arch="glm_moe_dsa", mtp_layers=1)


def test_init_model_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--hidden"):
        tiny_model.TinyModelSpec(hidden=65, heads=4)
    with pytest.raises(ConfigError, match="--vocab"):
        tiny_model.TinyModelSpec(vocab=100)


def test_weight_load_rejects_mismatch_and_keeps_old(tmp_path: Path) -> None:
    out = _write(tmp_path / "m")
    cfg = ModelConfig.from_dir(out)
    model = TinyLM(cfg, read_safetensors_dir(out))
    before = model.params["model.norm.weight"].clone()
    with pytest.raises(WeightMismatch, match="shape"):
        model.load({"model.norm.weight": torch.zeros(3)}, complete=False)
    with pytest.raises(WeightMismatch, match="unknown"):
        model.load({"model.nope": torch.zeros(3)}, complete=False)
    with pytest.raises(WeightMismatch, match="missing"):
        model.load({"model.norm.weight": torch.zeros(64)}, complete=True)
    assert torch.equal(model.params["model.norm.weight"], before)


def test_sampling_params_and_choice() -> None:
    with pytest.raises(ValueError, match="top_p"):
        parse_sampling_params({"top_p": 0})
    with pytest.raises(ValueError, match="bogus"):
        parse_sampling_params({"bogus": 1})
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    c = choose_tokens(logits, [SamplingParams(temperature=0.0)], [gen], False)
    toks, lps = c.tokens, c.logprobs
    assert toks == [1] and lps[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    # top_k=2 at a high temperature only ever picks the two best tokens
    picks = {
        choose_tokens(logits, [SamplingParams(temperature=5.0, top_k=2)], [gen], False).tokens[0]
        for _ in range(50)
    }
    assert picks <= {1, 3} and len(picks) == 2
    # sampled rows report log_softmax(logits / T) by default, raw log_softmax when asked
    c = choose_tokens(logits, [SamplingParams(temperature=2.0)], [gen], False)
    assert c.logprobs[0] == pytest.approx(float(torch.log_softmax(logits / 2.0, -1)[0, c.tokens[0]]))
    c = choose_tokens(logits, [SamplingParams(temperature=2.0)], [gen], True)
    toks, lps = c.tokens, c.logprobs
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, toks[0]]))


def test_sampled_tokens_follow_the_filtered_distribution_and_each_rows_seed() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 400
    logits = probs.log().expand(rows, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(rows)]
    counts = torch.zeros(4)
    for _ in range(10):
        c = choose_tokens(logits, [SamplingParams(temperature=1.0)] * rows, gens, False)
        counts += torch.bincount(torch.tensor(c.tokens), minlength=4)
    assert (counts / counts.sum() - probs).abs().max() < 0.03, counts
    # top_p 0.6: the nucleus is the two best tokens (0.5 before the second is below 0.6), renormalised.
    c = choose_tokens(logits, [SamplingParams(temperature=1.0, top_p=0.6)] * rows, gens, False)
    picked = torch.bincount(torch.tensor(c.tokens), minlength=4) / rows
    assert picked[2:].sum() == 0 and abs(float(picked[0]) - 0.5 / 0.8) < 0.08, picked
    # A row's draws depend on its own generator only: the same seed gives the same token in any batch.
    alone = choose_tokens(
        logits[:1], [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(7)], False
    )
    mixed_gens = [torch.Generator().manual_seed(99), torch.Generator().manual_seed(7)]
    mixed = choose_tokens(logits[:2], [SamplingParams(temperature=1.0)] * 2, mixed_gens, False)
    assert mixed.tokens[1] == alone.tokens[0]
    # NaN logits (poisoned weights) have no distribution: the sampler refuses, naming the row.
    poisoned = logits[:2].clone()
    poisoned[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        choose_tokens(poisoned, [SamplingParams(temperature=1.0)] * 2, mixed_gens, False)


def test_tensor_payload_round_trip_and_restricted_unpickler() -> None:
    named = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.float32))]
    alive: list[torch.Tensor] = []
    decoded = decode_named_tensors(encode_named_tensors(named, alive))
    assert [n for n, _ in decoded] == ["a", "b"]
    for (_, x), (_, y) in zip(named, decoded, strict=True):
        assert torch.equal(x, y)
    with pytest.raises(PayloadRejected, match=r"os\.system"):
        decode_named_tensors(base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode())
    with pytest.raises(PayloadRejected, match="pairs"):
        decode_named_tensors(base64.b64encode(pickle.dumps([1, 2])).decode())
    with pytest.raises(PayloadRejected, match="base64"):
        decode_named_tensors("not base64!")


def test_json_schema_must_be_json_text_and_the_refusal_names_it() -> None:
    from tether.rollout.cpu_engine.sampling import parse_sampling_params

    assert parse_sampling_params({"json_schema": '{"type": "array"}'}).json_schema == '{"type": "array"}'
    with pytest.raises(ValueError, match=r"sampling_params\.json_schema='\{not json': not JSON"):
        parse_sampling_params({"json_schema": "{not json"})
