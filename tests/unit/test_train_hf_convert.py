"""In-process units (no Megatron import): HF config mapping, the conversion layouts at TP 1/2/4,
checkpoint selection on disk, and the CPU patch switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tether.runtime.errors import ConfigError
from tether.train import checkpoint, hf_convert, megatron_cpu
from tether.train.hf_config import ModelArch, check_architecture_flags, check_parallel, load_arch

BASE = {
    "model_type": "qwen2",
    "vocab_size": 321,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def write_config(tmp: Path, **changes: object) -> Path:
    cfg = {**BASE, **changes}
    (tmp / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return tmp


def test_load_arch_maps_the_families(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path))
    assert (arch.qkv_bias, arch.qk_layernorm, arch.head_dim, arch.rope_theta) == (True, False, 8, 1e6)
    qwen3 = load_arch(write_config(tmp_path, model_type="qwen3", head_dim=16))
    assert (qwen3.qkv_bias, qwen3.qk_layernorm, qwen3.head_dim) == (False, True, 16)
    old_style = load_arch(write_config(tmp_path, model_type="llama", rope_parameters=None, rope_theta=5e5))
    assert old_style.rope_theta == 5e5 and old_style.rope_scaling_factor is None
    llama3 = load_arch(
        write_config(
            tmp_path,
            model_type="llama",
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 32.0,
                "low_freq_factor": 1.0,
            },
        )
    )
    assert llama3.rope_scaling_factor == 32.0


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model_type": "mixtral"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_load_arch_names_the_bad_field(tmp_path: Path, changes: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_arch(write_config(tmp_path, **changes))


def test_missing_checkpoint_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        load_arch(tmp_path / "nope")


def test_parallel_and_architecture_flag_checks(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path))
    check_parallel(arch, 4, 2)
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        check_parallel(arch, 8, 1)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        check_parallel(arch, 1, 3)
    check_architecture_flags(
        arch, {"num_layers": 4, "add_qkv_bias": True, "rotary_base": 1e6, "seq_length": 9}
    )
    with pytest.raises(ConfigError, match="--hidden-size=128"):
        check_architecture_flags(arch, {"hidden_size": 128})


def _hf_tensors(arch: ModelArch, g: torch.Generator) -> dict[str, list[torch.Tensor]]:
    h, d, q, kv, f = (
        arch.hidden_size,
        arch.head_dim,
        arch.num_attention_heads,
        arch.num_query_groups,
        arch.ffn_hidden_size,
    )
    return {
        "qkv": [
            torch.randn(q * d, h, generator=g),
            torch.randn(kv * d, h, generator=g),
            torch.randn(kv * d, h, generator=g),
        ],
        "qkv_bias": [
            torch.randn(q * d, generator=g),
            torch.randn(kv * d, generator=g),
            torch.randn(kv * d, generator=g),
        ],
        "fc1": [torch.randn(f, h, generator=g), torch.randn(f, h, generator=g)],
        "row": [torch.randn(h, q * d, generator=g)],
        "vocab": [torch.randn(arch.vocab_size, h, generator=g)],
        "replicated": [torch.randn(h, generator=g)],
    }


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_conversion_round_trips_bit_exact(tmp_path: Path, tp: int) -> None:
    arch = load_arch(write_config(tmp_path))
    g = torch.Generator().manual_seed(tp)
    kinds = {
        "qkv": "qkv",
        "qkv_bias": "qkv",
        "fc1": "fc1",
        "row": "row",
        "vocab": "vocab",
        "replicated": "replicated",
    }
    for key, tensors in _hf_tensors(arch, g).items():
        spec = hf_convert.ParamSpec(kinds[key], tuple(f"t{i}" for i in range(len(tensors))))  # type: ignore[arg-type]
        shards = [hf_convert.hf_to_megatron(arch, spec, tensors, r, tp) for r in range(tp)]
        if key == "vocab":
            assert sum(s.shape[0] for s in shards) == arch.padded_vocab_size(tp)
        back = [t for _, t in hf_convert.megatron_to_hf(arch, spec, shards)]
        for want, got in zip(tensors, back, strict=True):
            assert torch.equal(want, got), key


def test_qkv_layout_groups_query_heads_with_their_kv_head(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path, num_attention_heads=4, num_key_value_heads=2, hidden_size=8))
    d = arch.head_dim  # 2
    q = torch.arange(4 * d).float().repeat_interleave(1).view(4 * d, 1).expand(4 * d, 8)
    k = 100 + torch.arange(2 * d).float().view(2 * d, 1).expand(2 * d, 8)
    v = 200 + torch.arange(2 * d).float().view(2 * d, 1).expand(2 * d, 8)
    spec = hf_convert.ParamSpec("qkv", ("q", "k", "v"))
    rows = hf_convert.hf_to_megatron(arch, spec, [q, k, v], 0, 1)[:, 0].tolist()
    # group 0: q heads 0,1 then k head 0 then v head 0; group 1 likewise
    assert rows == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_param_spec_names_global_layers(tmp_path: Path) -> None:
    arch = load_arch(write_config(tmp_path, tie_word_embeddings=True))
    spec = hf_convert.param_spec(arch, "decoder.layers.1.mlp.linear_fc1.weight", lambda i: i + 2)
    assert spec.hf_names == ("model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight")
    assert hf_convert.param_spec(arch, "output_layer.weight", int).hf_names == ("model.embed_tokens.weight",)
    with pytest.raises(KeyError, match="no HF mapping"):
        hf_convert.param_spec(arch, "decoder.layers.0.mlp.router.weight", int)


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> None:
    d = root / checkpoint.iter_dir_name(step)
    (d / checkpoint.MODEL_OPTIM).mkdir(parents=True)
    if complete:
        (d / checkpoint.RUN_STATE).write_bytes(b"\x80")


def test_find_checkpoint_skips_incomplete_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert checkpoint.find_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2)
    (tmp_path / "iter_0000003.tmp" / checkpoint.MODEL_OPTIM).mkdir(parents=True)
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000002"  # no `latest`: newest complete
    (tmp_path / checkpoint.LATEST).write_text("1")
    assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000001"
    _fake_checkpoint(tmp_path, 4, complete=False)
    (tmp_path / checkpoint.LATEST).write_text("4")
    with caplog.at_level("WARNING"):
        assert checkpoint.find_checkpoint(tmp_path) == tmp_path / "iter_0000002"
    assert "no complete checkpoint" in caplog.text
    assert checkpoint.complete_checkpoints(tmp_path) == [1, 2]


def test_cpu_patches_follow_cuda_availability() -> None:
    assert megatron_cpu.needed() == (not torch.cuda.is_available())
