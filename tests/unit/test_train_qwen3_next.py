"""In-process units of Qwen3-Next's building blocks (`tether.train.model.families.qwen3_next`, `spec`): the
zero-centred RMSNorm and the gated output norm against transformers' modules, Megatron's
gated delta rule (its pure-torch path, given without flash-linear-attention) against transformers',
the HF ⇄ Megatron layouts of linear attention's projections and of the gated q_proj (exact, at TP 1
and 2), and the HF config read by `load_arch`. The whole model (logits, round trips, layouts) is
checked by tests/integration/test_train_model.py (CHECK_MODEL_FAMILIES=qwen3_next)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tether.runtime.errors import ConfigError
from tether.train.model import bridge
from tether.train.model.families import qwen3_next
from tether.train.model.hf_config import check_parallel, load_arch
from tether.train.model.mbridge_import import import_all
from tether.train.model.megatron_cpu import quiet_megatron_imports
from tether.train.model.spec import SequenceParallelTorchNorm, ZeroCenteredRMSNorm

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    # torch.compile machinery imported by megatron.core and mbridge warns about torch's own deprecations.
    with quiet_megatron_imports():
        import_all()
    import megatron.core.transformer.transformer_config  # noqa: F401

SHAPE = qwen3_next.LinearAttentionShape(key_heads=2, value_heads=4, key_dim=8, value_dim=6)


def _norm_config(**changes: object) -> SimpleNamespace:
    fields = {
        "layernorm_zero_centered_gamma": True,
        "memory_efficient_layer_norm": False,
        "normalization": "RMSNorm",
        "sequence_parallel": False,
    }
    return SimpleNamespace(**{**fields, **changes})


def test_zero_centred_norm_equals_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    ref = hf.Qwen3NextRMSNorm(32, eps=1e-6)
    norm = SequenceParallelTorchNorm(_norm_config(sequence_parallel=True), 32, eps=1e-6)
    assert isinstance(norm, ZeroCenteredRMSNorm)
    assert torch.equal(norm.weight, torch.zeros(32))  # 1 + 0: the identity scale, as transformers'
    weight = 0.1 * torch.randn(32, generator=g)
    with torch.no_grad():
        ref.weight.copy_(weight)
        norm.weight.copy_(weight)
    x = torch.randn(3, 5, 32, generator=g)
    assert torch.equal(norm(x), ref(x))
    assert norm.weight.sequence_parallel is True  # type: ignore[attr-defined]


def test_zero_centred_layer_norm_is_refused() -> None:
    with pytest.raises(ValueError, match="RMSNorm only"):
        SequenceParallelTorchNorm(_norm_config(normalization="LayerNorm"), 32)


def test_gated_output_norm_equals_transformers() -> None:
    g = torch.Generator().manual_seed(1)
    ref = hf.Qwen3NextRMSNormGated(16, eps=1e-6)
    norm = qwen3_next.GatedDeltaNetOutputNorm(_norm_config(), 16, eps=1e-6)
    weight = 1 + 0.1 * torch.randn(16, generator=g)
    with torch.no_grad():
        ref.weight.copy_(weight)
        norm.weight.copy_(weight)
    x, gate = torch.randn(10, 16, generator=g), torch.randn(10, 16, generator=g)
    # Megatron's GatedDeltaNet: out_norm(x) * SiLU(gate) (zero-centred gamma does not apply here).
    torch.testing.assert_close(norm(x) * F.silu(gate), ref(x, gate), rtol=0, atol=1e-6)


def test_megatron_gated_delta_rule_equals_transformers() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's imports warn about torch's own deprecations
        from megatron.core.ssm import gated_delta_net

        qwen3_next.torch_gated_delta_rule()
    assert gated_delta_net.HAVE_FLA  # fla is absent here: Megatron's torch rule stands in
    g = torch.Generator().manual_seed(2)
    b, s, h, dk, dv = 2, 70, 4, 8, 6  # 70 > one 64-token chunk
    q, k = torch.randn(b, s, h, dk, generator=g), torch.randn(b, s, h, dk, generator=g)
    v = torch.randn(b, s, h, dv, generator=g)
    decay = -torch.rand(b, s, h, generator=g)
    beta = torch.rand(b, s, h, generator=g)
    want, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    got, _ = gated_delta_net.chunk_gated_delta_rule(
        gated_delta_net.l2norm(q), gated_delta_net.l2norm(k), v, g=decay, beta=beta, initial_state=None
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _hf_split(qkvz: torch.Tensor, ba: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v, z, b, a (all heads, in head order) of one token, as transformers reorders them."""
    module = SimpleNamespace(
        num_k_heads=SHAPE.key_heads,
        num_v_heads=SHAPE.value_heads,
        head_k_dim=SHAPE.key_dim,
        head_v_dim=SHAPE.value_dim,
    )
    parts = hf.Qwen3NextGatedDeltaNet.fix_query_key_value_ordering(
        module,  # type: ignore[arg-type]
        qkvz.reshape(1, 1, -1),
        ba.reshape(1, 1, -1),
    )
    return [p.reshape(-1) for p in parts]


def test_in_proj_layout_matches_transformers_and_round_trips() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = 5
    qkvz = torch.randn(sum(SHAPE.in_proj_parts()[:4]), hidden, generator=g)
    ba = torch.randn(2 * SHAPE.value_heads, hidden, generator=g)
    in_proj = qwen3_next.in_proj_to_mcore(qkvz, ba, SHAPE)
    x = torch.randn(hidden, generator=g)
    # Megatron splits in_proj(x) into [q, k, v, z, b, a] in that order (TP=1).
    got = list((in_proj @ x).split(SHAPE.in_proj_parts()))
    for mine, theirs in zip(got, _hf_split(qkvz @ x, ba @ x), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    back = qwen3_next.in_proj_to_hf(in_proj, SHAPE)
    assert torch.equal(back[0], qkvz) and torch.equal(back[1], ba)


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_split_keeps_each_part_whole_per_rank(tp: int) -> None:
    parts = SHAPE.in_proj_parts()
    full = torch.arange(sum(parts) * 3, dtype=torch.float32).reshape(-1, 3)
    shards = qwen3_next.split_parts(full, parts, tp)
    assert [s.shape[0] for s in shards] == [sum(parts) // tp] * tp
    assert torch.equal(qwen3_next.merge_parts(shards, parts), full)
    # Rank r holds the r-th share of every part, in Megatron's [q, k, v, z, b, a] order.
    for r, shard in enumerate(shards):
        for mine, whole in zip(shard.split([p // tp for p in parts]), full.split(parts), strict=True):
            assert torch.equal(mine, whole.chunk(tp)[r])


def test_gated_qkv_layout_round_trips_per_group() -> None:
    groups, heads, head_dim, hidden = 2, 4, 3, 5
    g = torch.Generator().manual_seed(4)
    q = torch.randn(heads * 2 * head_dim, hidden, generator=g)
    k, v = (torch.randn(groups * head_dim, hidden, generator=g) for _ in range(2))
    qkv = qwen3_next.gated_qkv_to_mcore(q, k, v, groups, head_dim)
    per_group = qkv.reshape(groups, -1, hidden)
    # Group 0: its heads' queries (head 0, head 1), then their gates, then key 0 and value 0.
    hf_heads = q.reshape(heads, 2, head_dim, hidden)
    assert torch.equal(per_group[0, :head_dim], hf_heads[0, 0])
    assert torch.equal(per_group[0, 2 * head_dim : 3 * head_dim], hf_heads[0, 1])
    assert torch.equal(per_group[1, :head_dim], hf_heads[2, 0])
    assert torch.equal(per_group[0, 4 * head_dim : 5 * head_dim], k[:head_dim])
    back = qwen3_next.gated_qkv_to_hf(qkv, groups, heads, head_dim)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


CONFIG = {
    "model_type": "qwen3_next",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "full_attention_interval": 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [2],
    "norm_topk_prob": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


def _write(tmp: Path, **changes: object) -> Path:
    (tmp / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    return tmp


def test_load_arch_reads_qwen3_next(tmp_path: Path) -> None:
    arch = load_arch(_write(tmp_path))
    assert arch.linear_attention == (1, 0, 1, 0)  # a full-attention layer every 2
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads) == (2, 4)
    assert (arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_conv_kernel_dim) == (16, 16, 4)
    assert arch.attention_output_gate and arch.zero_centered_norms and arch.qk_layernorm
    assert arch.rotary_percent == 0.25 and not arch.qkv_bias
    assert arch.moe_layer_freq == (1, 1, 0, 1)  # mlp_only_layers=[2]
    assert arch.moe_shared_expert_intermediate_size == 48 and arch.moe_shared_expert_gate
    assert arch.moe_router_pre_softmax is False  # norm_topk_prob: softmax, top-k, renormalized
    listed = load_arch(_write(tmp_path, layer_types=["full_attention", *["linear_attention"] * 3]))
    assert listed.linear_attention == (0, 1, 1, 1)


def test_load_arch_refuses_a_bad_qwen3_next(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="layer_types"):
        load_arch(_write(tmp_path, layer_types=["sliding_attention"] * 4))
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        load_arch(_write(tmp_path, linear_num_value_heads=3))


def test_tp_must_divide_linear_attention_heads(tmp_path: Path) -> None:
    arch = load_arch(_write(tmp_path, linear_num_key_heads=1, linear_num_value_heads=4))
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        check_parallel(arch, 2, 1, sequence_parallel=True)


def test_context_parallel_is_accepted_for_linear_attention(tmp_path: Path) -> None:
    # Megatron asserts CP == 1 for GatedDeltaNet; tether runs its convolution and delta rule over the
    # gathered sequence (tests/integration/test_train_model.py checks CP=2 against DP=2).
    arch = load_arch(_write(tmp_path))
    check_parallel(arch, 2, 2, sequence_parallel=True, cp_size=2)
    check_parallel(arch, 1, 1, cp_size=2)


def test_slimes_qwen3_next_flags_are_checked_against_the_hf_config(tmp_path: Path) -> None:
    from tether.train.model.hf_config import check_architecture_flags

    arch = load_arch(_write(tmp_path))
    spec = ["slime_plugins.models.qwen3_next", "get_qwen3_next_spec"]
    flags = {"attention_output_gate": True, "use_gated_attention": True, "apply_layernorm_1p": True}
    check_architecture_flags(arch, {**flags, "spec": spec, "rotary_percent": 0.25, "qk_layernorm": True})
    qwen3 = load_arch(_write(tmp_path, model_type="qwen3"))
    for flag in flags:
        with pytest.raises(ConfigError, match="qwen3") as err:
            check_architecture_flags(qwen3, {flag: True})
        assert err.value.key == "--" + flag.replace("_", "-")
    with pytest.raises(ConfigError, match="builds Qwen3-Next's layers"):
        check_architecture_flags(qwen3, {"spec": spec})


def test_linear_attention_layers_on_the_te_spec_keep_the_local_names(tmp_path: Path) -> None:
    """Under TE's spec (not buildable without TransformerEngine: a stand-in TE block is checked)
    the linear-attention layers hold GatedDeltaNet with TE's linears and a TE input norm of their
    own, so their parameter names are the local spec's; full-attention layers keep TE's fused norm."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    hf_dir = _write(tmp_path)
    arch = load_arch(hf_dir)
    opened = bridge.open_bridge(
        arch,
        bridge.hf_config(hf_dir),
        dtype=torch.float32,
        parallel=bridge.parallel_states(tp_size=1, pp_size=1),
    )
    config = bridge.build_config(arch, bridge.config_kwargs(dict(opened.config), arch, {}))
    pattern = arch.linear_attention or ()
    assert 0 in pattern and 1 in pattern

    class StandInAttention:
        pass

    te_like = TransformerBlockSubmodules(
        layer_specs=[
            ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=IdentityOp, self_attention=ModuleSpec(module=StandInAttention)
                ),
            )
            for _ in pattern
        ]
    )
    blocks = {
        True: qwen3_next.with_gated_delta_net(te_like, config, True, 0),
        False: bridge.layer_spec(config, transformer_engine=False, pp_rank=0),
    }
    for te, block in blocks.items():
        for linear, layer in zip(pattern, block.layer_specs, strict=True):
            attention = layer.submodules.self_attention
            if not linear:
                assert attention.module is not GatedDeltaNet
                if te:
                    assert layer.submodules.input_layernorm is IdentityOp  # fused into linear_qkv
                continue
            assert attention.module is GatedDeltaNet
            assert attention.submodules.out_norm is qwen3_next.GatedDeltaNetOutputNorm
            if te:
                assert layer.submodules.input_layernorm is te_ext.TENorm
                assert attention.submodules.in_proj is te_ext.TEColumnParallelLinear
                assert attention.submodules.out_proj is te_ext.TERowParallelLinear
            else:
                assert layer.submodules.input_layernorm is not IdentityOp
                assert attention.submodules.in_proj is ColumnParallelLinear
                assert attention.submodules.out_proj is RowParallelLinear
