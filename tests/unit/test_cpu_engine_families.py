"""The CPU engine's forward for every model family `tether init-model --arch` writes (MoE blocks,
multi-latent attention (DeepSeek-V3, GLM-4.7-Flash, and Kimi-K2 against DeepseekV3ForCausalLM on the
same weights), DeepSeek sparse attention (GLM-5 with shared-indexer layers, DeepSeek-V3.2), GLM-4's
norms and partial rotary) against transformers, in this process:
logits and greedy tokens at prefill and decode, the experts each token is routed to (what
`return_routed_experts` reports) against the experts transformers' routers pick, the scheduler's
routed_experts answer, weight updates under the families' names, and what is refused by name."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from support.engines import FAMILY_LAYERS, decode_routed_experts, hf_routed_experts, local_plan_engine
from tokenizers import Tokenizer

from tether.rollout.cpu_engine import server
from tether.rollout.cpu_engine.modeling import tiny_model
from tether.rollout.cpu_engine.modeling.model import (
    KVCache,
    ModelConfig,
    ModelConfigError,
    Routes,
    TinyLM,
    WeightMismatch,
    read_safetensors_dir,
    unfuse_experts,
)
from tether.rollout.cpu_engine.sampling import SamplingParams
from tether.rollout.cpu_engine.scheduler import Request, Scheduler
from tether.rollout.engine_api.launch import EngineLaunchConfig, build_launch, sglang_flags
from tether.rollout.engine_api.weights import decode_named_tensors, encode_named_tensors
from tether.runtime.errors import ConfigError

ARCHES = list(tiny_model.ARCHES)
MOE_ARCHES = sorted(tiny_model.MOE_ARCHES)
# Families that keep layer 0 dense (first_k_dense_replace=1, GLM-4.7-Flash's mlp_layer_types).
DENSE_FIRST = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "kimi_k2", "glm_moe_dsa", "deepseek_v32")
DSA_ARCHES = ("glm_moe_dsa", "deepseek_v32")
TOL = 1e-5


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The tiny model of a family (built once per module and seed)."""
    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, seed: int = 0) -> Path:
        if (arch, seed) not in built:
            spec = tiny_model.TinyModelSpec(arch=arch, layers=FAMILY_LAYERS.get(arch, 2), seed=seed)  # type: ignore[arg-type]
            built[arch, seed] = tiny_model.write_tiny_model(tmp_path_factory.mktemp(f"{arch}-{seed}"), spec)
        return built[arch, seed]

    return get


def _hf(path: Path) -> Any:
    from support.hf_reference import load_causal_lm

    return load_causal_lm(path)


def _engine(path: Path) -> tuple[ModelConfig, TinyLM, KVCache]:
    cfg = ModelConfig.from_dir(path)
    return cfg, TinyLM(cfg, read_safetensors_dir(path)), KVCache(cfg)


def _hf_routes(path: Path, ids: list[int]) -> dict[int, torch.Tensor]:
    return hf_routed_experts(str(path), ids)


@pytest.mark.parametrize("arch", ARCHES)
def test_family_forward_equals_transformers(family: Callable[..., Path], arch: str) -> None:
    """Two prompts of different lengths in one batch: prefill, then three batched decode steps;
    every step's logits equal transformers' over the whole sequence, and greedy picks agree."""
    path = family(arch)
    cfg, model, cache = _engine(path)
    assert cfg.model_type == arch
    hf = _hf(path)
    prompts = [[1, 5, 6, 7, 8, 40, 41, 200], [9, 3]]
    slots = [cache.allocate(16) for _ in prompts]
    seqs = [list(p) for p in prompts]
    steps: list[torch.Tensor] = []
    with torch.inference_mode():
        logits = model.prefill(prompts, slots, cache)
        for _ in range(3):
            steps.append(logits)
            nxt = logits.argmax(-1).tolist()
            for seq, tok in zip(seqs, nxt, strict=True):
                seq.append(tok)
            logits = model.decode(nxt, [len(s) - 1 for s in seqs], slots, cache)
        steps.append(logits)
        for row, seq in enumerate(seqs):
            ref = hf(torch.tensor([seq])).logits[0]
            start = len(prompts[row]) - 1
            for j, got in enumerate(steps):
                want = ref[start + j]
                assert torch.allclose(got[row], want, atol=TOL), (
                    arch,
                    row,
                    j,
                    float((got[row] - want).abs().max()),
                )
                assert torch.allclose(torch.log_softmax(got[row], -1), torch.log_softmax(want, -1), atol=TOL)
                if j < 3:
                    assert seq[start + j + 1] == int(want.argmax()), (arch, row, j)


@pytest.mark.parametrize("arch", MOE_ARCHES)
def test_routed_experts_equal_transformers_router(family: Callable[..., Path], arch: str) -> None:
    """The experts the engine routes each position to, at prefill and at decode, are the ones
    transformers' router picks for the same tokens; dense layers report none."""
    path = family(arch)
    cfg, model, cache = _engine(path)
    assert cfg.moe is not None
    seq = torch.randint(0, cfg.vocab, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt, rest = seq[:20], seq[20:]
    slot = cache.allocate(32)
    chunks: list[Routes] = []
    with torch.inference_mode():
        routes: Routes = {}
        model.prefill([prompt], [slot], cache, routes)
        chunks.append(routes)
        for j, tok in enumerate(rest):
            routes = {}
            model.decode([tok], [len(prompt) + j], [slot], cache, routes)
            chunks.append(routes)
    want = _hf_routes(path, seq)
    sparse = [i for i in range(cfg.layers) if cfg.sparse(i)]
    assert sorted(want) == sparse and all(sorted(c) == sparse for c in chunks)
    if arch in DENSE_FIRST:
        assert sparse[0] == 1  # first_k_dense_replace=1: layer 0 is dense
    for layer in sparse:
        got = torch.cat([c[layer][0] for c in chunks]).sort(-1).values
        assert torch.equal(got, want[layer]), (arch, layer)
        assert len({tuple(r) for r in got.tolist()}) > 1, "routing should depend on the token"


def test_deepseek_correction_bias_steers_routing(family: Callable[..., Path]) -> None:
    """The tiny deepseek_v3's non-zero e_score_correction_bias changes which experts are picked
    (so the routing checks above would catch an engine that ignored it), and the chosen pair
    always lies in one expert group (n_group=2, topk_group=1)."""
    path = family("deepseek_v3")
    cfg, model, cache = _engine(path)
    raw = json.loads((path / "config.json").read_text())
    assert raw["n_group"] == 2 and raw["topk_group"] == 1 and raw["n_routed_experts"] == 4
    seq = torch.randint(0, cfg.vocab, (48,), generator=torch.Generator().manual_seed(5)).tolist()

    def routes() -> Routes:
        out: Routes = {}
        with torch.inference_mode():
            model.prefill([seq], [cache.allocate(64)], cache, out)
        return out

    before = routes()
    for layer, ids in before.items():
        pairs = {tuple(sorted(r)) for r in ids[0].tolist()}
        assert pairs <= {(0, 1), (2, 3)}, (layer, pairs)
    biases = [n for n in model.params if n.endswith("e_score_correction_bias")]
    assert biases and all(model.params[n].abs().min() > 0 for n in biases)
    for name in biases:
        model.params[name].zero_()
    after = routes()
    assert any(not torch.equal(before[i], after[i]) for i in before)


def _save_hf(config: Any, out: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers wide enough that tokens route differently
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


# GLM-4.7-Flash's attention and router (one group), with only the layer pattern left to `extra`.
GLM4_MOE_LITE_SMALL: dict[str, Any] = {
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
}


@pytest.mark.parametrize(
    ("arch", "extra", "sparse"),
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, [True, False, True]),
        ("qwen2_moe", {"decoder_sparse_step": 2}, [False, True, False]),
        ("qwen2_moe", {"norm_topk_prob": True}, [True] * 3),
        # GLM-4.7-Flash: any pattern of mlp_layer_types, not only dense layers first.
        ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "dense", "sparse"]}, [True, False, True]),
    ],
)
def test_dense_and_sparse_layer_layouts(
    tmp_path: Path, arch: str, extra: dict[str, Any], sparse: list[bool]
) -> None:
    """mlp_only_layers, decoder_sparse_step and mlp_layer_types put dense MLPs between MoE layers
    (and Qwen2-MoE with normalised top-k weights); the engine follows each and still equals
    transformers."""
    import transformers

    kinds = {"qwen3_moe": transformers.Qwen3MoeConfig, "glm4_moe_lite": transformers.Glm4MoeLiteConfig}
    moe = GLM4_MOE_LITE_SMALL if arch == "glm4_moe_lite" else {"num_key_value_heads": 2, "num_experts": 4}
    config = kinds.get(arch, transformers.Qwen2MoeConfig)(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_experts_per_tok=2,
        **moe,
        **extra,
    )
    path = _save_hf(config, tmp_path / "m")
    cfg, model, cache = _engine(path)
    assert cfg.moe is not None and list(cfg.moe.sparse_layers) == sparse
    seq = list(range(3, 19))
    routes: Routes = {}
    with torch.inference_mode():
        logits = model.prefill([seq], [cache.allocate(32)], cache, routes)
    hf = _hf(path)
    with torch.inference_mode():
        ref = hf(torch.tensor([seq])).logits[0, -1]
    assert torch.allclose(logits[0], ref, atol=TOL)
    want = _hf_routes(path, seq)
    assert sorted(routes) == sorted(want) == [i for i, s in enumerate(sparse) if s]
    for layer, ids in routes.items():
        assert torch.equal(ids[0].sort(-1).values, want[layer])


@pytest.mark.parametrize(
    "extra",
    [
        # Moonlight/Kimi-style: no q_lora_rank (a plain q_proj), no grouping, two shared experts.
        {
            "q_lora_rank": None,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 2,
            "first_k_dense_replace": 0,
        },
        # The non-interleaved rope layout, unnormalised top-k weights, 8 experts in 4 groups.
        {
            "rope_interleave": False,
            "norm_topk_prob": False,
            "n_routed_experts": 8,
            "n_group": 4,
            "topk_group": 2,
        },
    ],
)
def test_deepseek_variants(tmp_path: Path, extra: dict[str, Any]) -> None:
    import transformers

    base: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "q_lora_rank": 16,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 6,
        "first_k_dense_replace": 1,
        "num_mtp_layers": 0,
    }
    path = _save_hf(transformers.DeepseekV3Config(**{**base, **extra}), tmp_path / "m")
    named = read_safetensors_dir(path)
    for name in [n for n in named if n.endswith("e_score_correction_bias")]:  # non-zero, as in init-model
        named[name] = torch.linspace(-0.3, 0.3, named[name].numel())
    from safetensors.torch import save_file

    save_file(named, str(path / "model.safetensors"))
    cfg, model, cache = _engine(path)
    assert cfg.mla is not None and cfg.mla.q_lora_rank == (extra.get("q_lora_rank", 16) or 0)
    seq = list(range(3, 19))
    slot = cache.allocate(32)
    routes: Routes = {}
    with torch.inference_mode():
        first = model.prefill([seq[:12]], [slot], cache)
        steps = [model.decode([t], [11 + j + 1], [slot], cache) for j, t in enumerate(seq[12:])]
    hf = _hf(path)
    with torch.inference_mode():
        ref = hf(torch.tensor([seq])).logits[0]
    assert torch.allclose(first[0], ref[11], atol=TOL)
    for j, step in enumerate(steps):
        assert torch.allclose(step[0], ref[12 + j], atol=TOL), j
    cache2 = KVCache(cfg)
    with torch.inference_mode():
        model.prefill([seq], [cache2.allocate(32)], cache2, routes)
    want = _hf_routes(path, seq)
    assert sorted(routes) == sorted(want)
    for layer, ids in routes.items():
        assert torch.equal(ids[0].sort(-1).values, want[layer])


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(
    ("arch", "change", "named"),
    [
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
            "llama3",
        ),
        ("qwen3", {"rope_scaling": {"type": "linear", "factor": 4.0}}, "linear"),
        ("qwen3", {"rope_scaling": {"type": "yarn", "factor": -1.0}}, "factor=-1.0"),
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy'"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ("kimi_k2", {"attention_bias": True}, "attention_bias=true is not supported for kimi_k2"),
        ("kimi_k2", {"topk_method": "greedy"}, "topk_method='greedy'"),
        ("glm4_moe_lite", {"attention_bias": True}, "attention_bias=true is not supported for glm4_moe_lite"),
        ("glm4_moe_lite", {"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types="),
        ("glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse"]}, "each of the 4 layers"),
        # Without mlp_layer_types transformers keeps only layer 0 dense, whatever this says.
        ("glm4_moe_lite", {"mlp_layer_types": None, "first_k_dense_replace": 2}, "first_k_dense_replace=2"),
        ("glm4_moe_lite", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen3_moe", {"use_sliding_window": True}, "sliding window"),
        ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention"]}, "sliding window"),
        ("mixtral", {"sliding_window": 4096}, "sliding_window=4096"),
        ("glm4_moe", {"n_group": 3}, "n_group=3"),
        ("glm4", {"model_type": "glm"}, "model_type='glm'"),
        ("minimax_m2", {"use_routing_bias": False}, "use_routing_bias=False"),
        ("minimax_m2", {"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
        ("minimax_m2", {"attn_type_list": [0, 1]}, "attn_type_list"),
        ("qwen3_next", {"attention_bias": True}, "attention_bias=true is not supported for qwen3_next"),
        ("qwen3_next", {"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types="),
        ("qwen3_next", {"layer_types": ["full_attention"]}, "each of the 4 layers"),
        ("qwen3_next", {"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
        ("qwen3_next", {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim=0"),
        ("qwen3_next", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen3_next", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "linear"),
        ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full", "full"]}, "layer 0 is 'shared'"),
        ("glm_moe_dsa", {"indexer_types": ["full", "sparse", "full", "full"]}, "indexer_types="),
        ("glm_moe_dsa", {"attention_bias": True}, "attention_bias=true is not supported for glm_moe_dsa"),
        ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank is missing"),
        ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim=4 is smaller than qk_rope_head_dim=8"),
        ("deepseek_v32", {"index_topk": 0}, "index_topk=0"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    family: Callable[..., Path], tmp_path: Path, arch: str, change: dict[str, Any], named: str
) -> None:
    src = family(arch)
    raw = {**_config(src), **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=named.replace("(", r"\(").replace("[", r"\[")) as err:
        ModelConfig.from_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize(
    "arch",
    [
        "deepseek_v3",
        "glm4_moe_lite",
        "mixtral",
        "glm4",
        "qwen2_moe",
        "minimax_m2",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_moe",
        "glm_moe_dsa",
        "deepseek_v32",
    ],
)
def test_weight_updates_take_the_families_names(family: Callable[..., Path], arch: str) -> None:
    """A full load of another seed's checkpoint (the disk path), a partial update of a few
    experts, routers and MLA/sandwich-norm tensors through the tensor payload (the tensor and
    distributed paths check names the same way), and refusals of unknown names and shapes."""
    v1, v2 = family(arch, 0), family(arch, 1)
    assert ModelConfig.from_dir(v1) == ModelConfig.from_dir(v2)  # /update_weights_from_disk's check
    cfg, model, _ = _engine(v1)
    fresh = read_safetensors_dir(v2)
    prompt = [[1, 5, 6, 7, 8]]

    def logits(m: TinyLM) -> torch.Tensor:
        c = KVCache(cfg)
        with torch.inference_mode():
            return m.prefill(prompt, [c.allocate(8)], c)

    ref = logits(TinyLM(cfg, fresh))
    model.load(dict(fresh), complete=True)
    assert torch.equal(logits(model), ref)
    back = read_safetensors_dir(v1)
    picked = {
        n: t
        for n, t in back.items()
        if any(
            k in n
            for k in (
                "experts.1.",
                "gate.",
                "kv_b_proj",
                "q_a_layernorm",
                "post_mlp_layernorm",
                "gate_up_proj",
                "w2",
                "linear_attn.",
                "q_norm",
                "indexer.",
            )
        )
    }
    assert picked
    model.load(dict(decode_named_tensors(encode_named_tensors(list(picked.items()), []))), complete=False)
    for name, tensor in unfuse_experts(picked).items():  # a fused experts tensor by each expert's
        assert torch.equal(model.params[cfg.canonical(name)], tensor), name
    with pytest.raises(WeightMismatch, match="unknown parameter name"):
        # Experts 0-3 exist (on MoE layers only); a fifth is no parameter of any family.
        model.load({"model.layers.1.mlp.experts.4.gate_proj.weight": torch.zeros(32, 64)}, complete=False)
    if arch in DENSE_FIRST:
        with pytest.raises(WeightMismatch, match="unknown parameter name"):  # layer 0 is dense
            model.load({"model.layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)}, complete=False)
    name = next(n for n in picked if n.endswith(".weight") and len(picked[n].shape) == 2)
    with pytest.raises(WeightMismatch, match="shape"):
        model.load({name: torch.zeros(3, 3)}, complete=False)
    with pytest.raises(WeightMismatch, match="missing parameters"):
        model.load({name: picked[name]}, complete=True)


# ----- Qwen3-Next: linear attention's per-slot states -----


def _assert_follows_hf(hf: Any, seq: list[int], start: int, steps: list[torch.Tensor]) -> float:
    """steps[j] equals transformers' logits at position start + j of seq; the largest difference."""
    with torch.inference_mode():
        ref = hf(torch.tensor([seq])).logits[0]
    worst = 0.0
    for j, got in enumerate(steps):
        diff = float((got - ref[start + j]).abs().max())
        assert diff <= TOL, (start, j, diff)
        worst = max(worst, diff)
    return worst


def test_qwen3_next_states_follow_their_slots(family: Callable[..., Path]) -> None:
    """The gated delta net's conv window and recurrent state live in the request's slot: a prompt
    longer than one 64-token chunk, a freed slot taken by a new prompt while the others decode,
    decode batches whose slots are not consecutive nor in order, and one prompt prefilled for
    two slots (the n samples of a group) that then decode different tokens. Every step equals
    transformers over the whole sequence."""
    path = family("qwen3_next")
    cfg, model, cache = _engine(path)
    assert cfg.gdn is not None and cfg.gdn.linear_layers == (True, False, True, False)
    hf = _hf(path)
    gen = torch.Generator().manual_seed(11)
    long, short, late = (torch.randint(0, cfg.vocab, (n,), generator=gen).tolist() for n in (70, 3, 9))
    seqs: dict[int, list[int]] = {}
    logits: dict[int, list[torch.Tensor]] = {}
    starts: dict[int, int] = {}

    def decode(order: list[int], feed: dict[int, int] | None = None) -> None:
        """One step of the slots in `order`, each fed its greedy token or the one `feed` gives."""
        toks = [(feed or {}).get(s, int(logits[s][-1].argmax())) for s in order]
        for s, tok in zip(order, toks, strict=True):
            seqs[s].append(tok)
        with torch.inference_mode():
            out = model.decode(toks, [len(seqs[s]) - 1 for s in order], order, cache)
        for row, s in enumerate(order):
            logits[s].append(out[row])

    def prefill(prompts: list[list[int]]) -> list[int]:
        slots = [cache.allocate(128) for _ in prompts]
        with torch.inference_mode():
            out = model.prefill(prompts, slots, cache)
        for row, (s, p) in enumerate(zip(slots, prompts, strict=True)):
            seqs[s], logits[s], starts[s] = list(p), [out[row]], len(p) - 1
        return slots

    a, b, c = prefill([long, short, list(short)])  # b and c share their prompt's prefill
    assert [a, b, c] == [0, 1, 2]
    assert torch.equal(logits[b][0], logits[c][0])
    decode([a, b, c], feed={c: (int(logits[c][0].argmax()) + 1) % cfg.vocab})  # c samples another token
    decode([c, a, b])
    assert seqs[c][:-2] == seqs[b][:-2] and seqs[c][-2] != seqs[b][-2]
    assert _assert_follows_hf(hf, seqs.pop(b), starts.pop(b), logits.pop(b)) <= TOL
    cache.release(b)
    (d,) = prefill([late])  # the freed slot, its old states overwritten
    assert d == b
    for order in ([d, a, c], [c, d], [a, c, d]):
        decode(order)
    for s in (a, c, d):
        assert _assert_follows_hf(hf, seqs[s], starts[s], logits[s]) <= TOL


def test_qwen3_next_weight_update_by_name_matches_transformers(
    family: Callable[..., Path], tmp_path: Path
) -> None:
    """A partial update under Qwen3-Next's names (gated delta net, gated attention, zero-centred
    norms, routers, the shared expert and its gate) changes the engine's logits as the same
    weights change transformers'; the checkpoint's `mtp.*` tensors are accepted and left out."""
    import shutil

    from safetensors.torch import save_file

    v1, v2 = family("qwen3_next", 0), family("qwen3_next", 1)
    cfg, model, _ = _engine(v1)
    other = read_safetensors_dir(v2)
    keys = ("linear_attn.", "self_attn.q_proj", "q_norm", "layernorm", "mlp.gate.", "shared_expert")
    picked = {n: t for n, t in other.items() if any(k in n for k in keys)}
    assert {n.split(".")[-2] for n in picked} >= {
        "linear_attn",
        "conv1d",
        "in_proj_qkvz",
        "shared_expert_gate",
    }
    mtp = {"mtp.fc.weight": torch.zeros(8, 8), "mtp.layers.0.input_layernorm.weight": torch.zeros(8)}
    model.load(
        dict(decode_named_tensors(encode_named_tensors(list({**picked, **mtp}.items()), []))), complete=False
    )
    assert not any(n.startswith("mtp.") for n in model.params)
    merged = {**read_safetensors_dir(v1), **picked}
    out = tmp_path / "merged"
    shutil.copytree(v1, out)
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    seq = [1, 5, 6, 7, 8, 40, 41, 200]
    cache = KVCache(cfg)
    with torch.inference_mode():
        got = model.prefill([seq], [cache.allocate(16)], cache)
        before = _hf(v1)(torch.tensor([seq])).logits[0, -1]
        after = _hf(out)(torch.tensor([seq])).logits[0, -1]
    assert not torch.allclose(before, after, atol=1e-3)
    assert torch.allclose(got[0], after, atol=TOL), float((got[0] - after).abs().max())
    with pytest.raises(WeightMismatch, match="unknown parameter name"):  # layer 1 is full attention
        model.load({"model.layers.1.linear_attn.A_log": torch.zeros(4)}, complete=False)
    with pytest.raises(WeightMismatch, match="unknown parameter name"):  # layer 0 is linear attention
        model.load({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 64)}, complete=False)
    with pytest.raises(WeightMismatch, match="shape"):  # q_proj holds the queries and their gates
        model.load({"model.layers.1.self_attn.q_proj.weight": torch.zeros(64, 64)}, complete=False)


def test_qwen3_next_config_defaults(family: Callable[..., Path], tmp_path: Path) -> None:
    """Without layer_types the layers follow full_attention_interval, without a rotary factor a
    quarter of the head rotates, as transformers' Qwen3NextConfig reads them."""
    raw = _config(family("qwen3_next"))
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw["full_attention_interval"] = 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.gdn is not None and cfg.gdn.linear_layers == (True, True, True, False)
    assert cfg.rotary_dim == cfg.head_dim // 4 and cfg.zero_centered_norm and cfg.attn_output_gate
    assert ModelConfig.from_dir(family("qwen3_next")).gdn.linear_layers == (True, False, True, False)  # type: ignore[union-attr]


# ----- DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): the indexer's top-k -----


def _hf_eager(path: Path) -> Any:
    """transformers' model with eager attention, where the indexer's top-k is folded into the mask."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _dsa_prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("arch", DSA_ARCHES)
def test_dsa_prefill_and_decode_equal_transformers(family: Callable[..., Path], arch: str) -> None:
    """Three prompts of 12-18 tokens (index_topk is 4) prefilled in one padded batch, then 10 decode
    steps with the slots in changing order: the log-probs at every prompt and generated position
    equal transformers' (eager) over the whole sequence. The indexer's keys are cached on the layers
    that run an indexer (none on GLM-5's shared layers 1 and 3), and attending to every key instead changes
    the answer, so the top-k is what is checked."""
    path = family(arch)
    cfg, model, cache = _engine(path)
    assert cfg.dsa is not None and cfg.dsa.topk == 4
    full = (True, False, True, False) if arch == "glm_moe_dsa" else (True,) * 4
    assert cfg.dsa.full_layers == full
    prompts = _dsa_prompts(cfg.vocab, (18, 12, 15), seed=7)
    prompts[1][-1] = _config(path)["pad_token_id"]  # its embedding is not zeros (see tiny_model)
    slots = [cache.allocate(40) for _ in prompts]
    assert [cache.stores[1][i].shape[1] for i in range(cfg.layers)] == [int(f) for f in full]
    seqs = [list(p) for p in prompts]
    scores: dict[int, torch.Tensor] = {}
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        logits = model.prefill(prompts, slots, cache, score_from=dict.fromkeys(range(3), 0), scores=scores)
        last = dict(enumerate(logits))
        for step in range(10):
            order = [0, 1, 2] if step % 2 == 0 else [2, 0, 1]  # not in slot order: gathered rows
            toks = [int(last[r].argmax()) for r in order]
            for r, tok in zip(order, toks, strict=True):
                seqs[r].append(tok)
            out = model.decode(toks, [len(seqs[r]) - 1 for r in order], [slots[r] for r in order], cache)
            for row, r in enumerate(order):
                last[r] = out[row]
                got[r].append(out[row])
        hf = _hf_eager(path)
        for r, seq in enumerate(seqs):
            ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1)
            mine = torch.log_softmax(torch.cat([scores[r], torch.stack(got[r])]), -1)
            assert mine.shape == ref.shape
            diff = (mine - ref).abs().amax(-1)
            assert float(diff.max()) <= TOL, (arch, r, diff.tolist())
        dense_cfg = msgspec.structs.replace(cfg, dsa=msgspec.structs.replace(cfg.dsa, topk=10**6))
        dense_cache = KVCache(dense_cfg)
        dense = TinyLM(dense_cfg, model.params).prefill([seqs[0]], [dense_cache.allocate(40)], dense_cache)
    assert float((dense[0] - got[0][-1]).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"index_topk_freq": 3},
        {"index_topk_freq": 2, "index_skip_topk_offset": 4},
        {"index_topk_pattern": "FSFFSSF"},
        {"index_topk_pattern": ["full", "full", "shared", "shared", "full", "shared", "shared"]},
    ],
)
def test_glm_moe_dsa_indexer_types_as_transformers_derives_them(
    family: Callable[..., Path], tmp_path: Path, keys: dict[str, Any]
) -> None:
    """Without indexer_types the shared layers follow index_topk_pattern, else index_topk_freq and
    index_skip_topk_offset, as transformers' GlmMoeDsaConfig derives them."""
    import transformers

    raw = _config(family("glm_moe_dsa"))
    for key in ("indexer_types", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"):
        raw.pop(key, None)
    layers = 7
    raw |= {
        **keys,
        "num_hidden_layers": layers,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "layer_types": ["indexed_attention"] * layers,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    dsa = ModelConfig.from_dir(tmp_path).dsa
    want = transformers.GlmMoeDsaConfig(num_hidden_layers=layers, **keys).indexer_types
    assert dsa is not None and [("full" if f else "shared") for f in dsa.full_layers] == want


def test_dsa_indexer_update_matches_transformers(family: Callable[..., Path], tmp_path: Path) -> None:
    """A partial update of GLM-5's indexer tensors alone (another seed's, through the tensor
    payload) changes the engine's log-probs as the same weights change transformers'; a shared
    layer has no indexer tensor to update."""
    import shutil

    from safetensors.torch import save_file

    v1, v2 = family("glm_moe_dsa", 0), family("glm_moe_dsa", 1)
    cfg, model, _ = _engine(v1)
    picked = {n: t for n, t in read_safetensors_dir(v2).items() if ".self_attn.indexer." in n}
    assert {n.split(".")[2] for n in picked} == {"0", "2"}
    assert {n.split(".indexer.")[1] for n in picked} == {
        "wq_b.weight",
        "wk.weight",
        "k_norm.weight",
        "k_norm.bias",
        "weights_proj.weight",
    }
    model.load(dict(decode_named_tensors(encode_named_tensors(list(picked.items()), []))), complete=False)
    out = tmp_path / "merged"
    shutil.copytree(v1, out)
    save_file(
        {**read_safetensors_dir(v1), **picked}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (seq,) = _dsa_prompts(cfg.vocab, (16,), seed=2)
    cache = KVCache(cfg)
    scores: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        model.prefill([seq], [cache.allocate(16)], cache, score_from={0: 0}, scores=scores)
        before = _hf_eager(v1)(torch.tensor([seq])).logits[0]
        after = _hf_eager(out)(torch.tensor([seq])).logits[0]
    assert not torch.allclose(before, after, atol=1e-3)
    assert torch.allclose(scores[0], after, atol=TOL), float((scores[0] - after).abs().max())
    with pytest.raises(WeightMismatch, match="unknown parameter name"):  # layer 1 shares layer 0's
        model.load({"model.layers.1.self_attn.indexer.wk.weight": torch.zeros(16, 64)}, complete=False)
    with pytest.raises(WeightMismatch, match="shape"):
        model.load(
            {"model.layers.2.self_attn.indexer.weights_proj.weight": torch.zeros(4, 64)}, complete=False
        )


def test_init_model_family_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--kv-heads=2: multi-latent attention"):
        tiny_model.TinyModelSpec(arch="deepseek_v3", kv_heads=2)
    with pytest.raises(ConfigError, match=r"--kv-heads=2: multi-latent attention \(glm4_moe_lite\)"):
        tiny_model.TinyModelSpec(arch="glm4_moe_lite", kv_heads=2)
    with pytest.raises(ConfigError, match="--layers=1: kimi_k2 keeps layer 0 dense"):
        tiny_model.TinyModelSpec(arch="kimi_k2", layers=1)
    with pytest.raises(ConfigError, match="--layers=1: glm4_moe keeps layer 0 dense"):
        tiny_model.TinyModelSpec(arch="glm4_moe", layers=1)
    with pytest.raises(ConfigError, match="--intermediate=130"):
        tiny_model.TinyModelSpec(arch="qwen3_moe", intermediate=130)
    parser = argparse.ArgumentParser()
    tiny_model.add_arguments(parser)
    for arch in ARCHES:
        assert parser.parse_args(["--out", "x", "--arch", arch]).arch == arch
    assert tiny_model.TinyModelSpec(arch="deepseek_v3").num_kv_heads == 4
    assert tiny_model.TinyModelSpec(arch="kimi_k2").num_kv_heads == 4
    assert tiny_model.TinyModelSpec(arch="qwen3_moe").num_kv_heads == 2


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "kimi_k2", *DSA_ARCHES])
def test_init_model_shapes_of_moe_families(family: Callable[..., Path], tmp_path: Path, arch: str) -> None:
    """What `tether init-model` promises: 4 experts top-2, a quarter-size expert FFN, layer 0
    dense, float32 weights, a non-zero correction bias on every MoE layer; the same seed writes
    the same weights, another seed others. kimi_k2 is deepseek_v3's model under Kimi-K2's
    config.json labels; glm4_moe_lite states its dense layer both ways, as GLM-4.7-Flash's does."""
    path = family(arch)
    raw = _config(path)
    assert raw["n_routed_experts"] == 4 and raw["num_experts_per_tok"] == 2
    assert raw["moe_intermediate_size"] == 32 and raw["first_k_dense_replace"] == 1
    named = read_safetensors_dir(path)
    if arch == "kimi_k2":
        assert raw["model_type"] == "kimi_k2" and raw["architectures"] == ["DeepseekV3ForCausalLM"]
        ds = read_safetensors_dir(family("deepseek_v3"))
        assert sorted(ds) == sorted(named) and all(torch.equal(ds[n], named[n]) for n in ds)
    if arch == "glm4_moe_lite":
        assert raw["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
        assert raw["v_head_dim"] == 2 * raw["qk_nope_head_dim"] and raw["n_group"] == 1
    assert all(t.dtype == torch.float32 for t in named.values())
    biases = sorted(n for n in named if n.endswith("e_score_correction_bias"))
    assert biases == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)]
    assert all(bool(named[n].abs().min() > 0) for n in biases)
    again = read_safetensors_dir(
        tiny_model.write_tiny_model(tmp_path / "again", tiny_model.TinyModelSpec(arch=arch, layers=4))
    )  # type: ignore[arg-type]
    assert sorted(again) == sorted(named) and all(torch.equal(again[n], named[n]) for n in named)
    other = read_safetensors_dir(family(arch, 1))
    assert not torch.equal(other[biases[0]], named[biases[0]])


# ----- routed experts through the scheduler (what /generate returns) -----


def _request(rid: str, prompt: list[int], n: int, *, routed: bool = True, start: int = 0) -> Request:
    return Request(
        rid=rid,
        prompt=prompt,
        params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
        return_logprob=True,
        generator=torch.Generator().manual_seed(0),
        return_routed_experts=routed,
        routed_experts_start_len=start,
    )


def _scheduler(path: Path) -> Scheduler:
    cfg = ModelConfig.from_dir(path)
    return Scheduler(
        cfg,
        TinyLM(cfg, read_safetensors_dir(path)),
        Tokenizer.from_file(str(path / "tokenizer.json")),
        weight_version="v1",
        context_length=256,
        max_running=8,
        original_logprob=False,
        seed=0,
        return_routed_experts=True,
    )


@pytest.fixture
def event_loop_runner() -> Iterator[Callable[[Any], Any]]:
    loop = asyncio.new_event_loop()
    try:
        yield loop.run_until_complete
    finally:
        loop.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "qwen3_next", "qwen3_5_moe", "glm_moe_dsa"])
def test_scheduler_returns_routed_experts_like_sglang(
    family: Callable[..., Path], arch: str, event_loop_runner: Callable[[Any], Any]
) -> None:
    """meta_info.routed_experts: base64 of int32 [prompt + completion - 1, layers, top_k], row i
    the experts position i was routed to (transformers' router picks for the same tokens), dense
    layers 0; routed_experts_start_len drops the rows before it; a request that did not ask gets
    none; rows stay right when a prefill shares a step with another request's decode, and
    after a retract mid-generation (re-prefill of prompt + output)."""
    path = family(arch)
    sched = _scheduler(path)
    assert sched.cfg.moe is not None
    layers, topk = sched.cfg.layers, sched.cfg.moe.top_k
    prompt = [1, 5, 6, 7, 8, 40, 41, 200, 17]
    full, late, plain, retracted = (
        _request("full", prompt, 6),
        _request("late", prompt, 6, start=4),
        _request("plain", prompt, 6, routed=False),
        _request("retracted", prompt, 6),
    )

    async def scenario() -> None:
        task = asyncio.create_task(sched.run())
        try:
            sched.submit(full)
            while len(full.output) < 2:  # the others' prefill then shares a step with its decode
                full.progress.clear()
                await full.progress.wait()
            sched.submit(late)
            sched.submit(plain)
            for req in (full, late, plain):
                await req.done.wait()
            sched.submit(retracted)
            while len(retracted.output) < 3:
                retracted.progress.clear()
                await retracted.progress.wait()

            async def retract() -> None:
                sched.pause("retract")
                sched.resume()

            await sched.between_steps(retract)
            await retracted.done.wait()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sched.close()

    event_loop_runner(scenario())
    assert "routed_experts" not in sched.response(plain)["meta_info"]
    seq = prompt + full.output[:-1]
    want = _hf_routes(path, seq)
    for req in (full, retracted):
        assert req.output == full.output
        got = decode_routed_experts(sched.response(req)["meta_info"], layers, topk)
        assert got.shape == (len(prompt) + len(req.output) - 1, layers, topk)
        for layer in range(layers):
            rows = got[:, layer].sort(-1).values
            if layer in want:
                assert torch.equal(rows, want[layer].to(torch.int32)), (req.rid, layer)
            else:
                assert not rows.any(), f"dense layer {layer} reports experts"
    assert sched.response(late)["meta_info"]["routed_experts_start_len"] == 4
    assert sched.response(full)["meta_info"]["routed_experts_start_len"] == 0
    whole = decode_routed_experts(sched.response(full)["meta_info"], layers, topk)
    assert torch.equal(decode_routed_experts(sched.response(late)["meta_info"], layers, topk), whole[4:])


def test_routed_experts_flag_reaches_both_engines_and_is_refused_for_dense(
    family: Callable[..., Path], event_loop_runner: Callable[[Any], Any]
) -> None:
    """EngineLaunchConfig.return_routed_experts (what --use-rollout-routing-replay sets) puts
    --enable-return-routed-experts on the CPU engine's and on SGLang's command line; the CPU
    engine refuses the flag for a model without MoE layers before it serves anything."""
    plan = local_plan_engine()
    for backend in ("cpu", "sglang"):
        cfg = EngineLaunchConfig(
            model_path="/m", backend=backend, device_kind="cpu", api_key="k", return_routed_experts=True
        )  # type: ignore[arg-type]
        (spec,) = build_launch(plan, cfg).specs
        assert "--enable-return-routed-experts" in spec.argv, spec.argv
        off = msgspec_replace(cfg, return_routed_experts=False)
        (spec,) = build_launch(plan, off).specs
        assert "--enable-return-routed-experts" not in spec.argv
    assert "enable-return-routed-experts" in sglang_flags(plan, plan.parts[0], cfg)
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--model-path", str(family("llama")), "--enable-return-routed-experts"])
    args.api_key = "k"
    threads = torch.get_num_threads()
    try:
        with pytest.raises(
            ConfigError, match="--enable-return-routed-experts=True: model_type='llama' has no MoE"
        ):
            event_loop_runner(server.serve(args))
    finally:
        torch.set_num_threads(threads)


def msgspec_replace(cfg: EngineLaunchConfig, **changes: Any) -> EngineLaunchConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)
