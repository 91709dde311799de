"""Multi-token prediction (--mtp-num-layers, --enable-mtp-training, --mtp-loss-scaling-factor) on a
real tiny MiMo (Qwen2 + one MTP layer) built through tether's model builder, in this process (a
one-rank gloo group on an in-memory store: no process is started).

The MTP loss is checked against an independent computation of MiMo's MTP layer with transformers'
Qwen2 modules and the checkpoint's own tensors (SGLang's MiMo layout: input_proj reads
[hidden_layernorm(h), token_layernorm(e)]); the main logits against the same checkpoint built
without MTP layers. Across TP/PP layouts and in a real training step: tests/integration/
test_train_model.py (check_model.py's mimo_mtp, mimo_mtp_frozen and deepseek_v3_mtp_built).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_megatron_args import ARCH

from tether.runtime.errors import ConfigError
from tether.train.config import MegatronConfig
from tether.train.model import bridge, megatron_args, mtp
from tether.train.model.hf_config import ModelArch, check_architecture_flags, check_mtp_layers

S, B = 10, 2  # sequence, batch

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _arch(model_type: str, mtp_layers: int = 1) -> ModelArch:
    # The Megatron-args tests' tiny shape, as a two-layer Qwen2-style model with MTP layers.
    return dataclasses.replace(
        ARCH, model_type=model_type, num_layers=2, num_query_groups=4, qkv_bias=True, mtp_layers=mtp_layers
    )


# ---- names and layouts (no model) ----


@pytest.mark.parametrize(
    ("model_type", "prefix"),
    [
        ("mimo", "model.mtp_layers.1."),
        ("deepseek_v3", "model.layers.3."),
        ("glm4_moe", "model.layers.3."),
        ("glm4_moe_lite", "model.layers.3."),
        ("kimi_k2", "model.layers.3."),
    ],
)
def test_mtp_weight_names_per_family(model_type: str, prefix: str) -> None:
    arch = _arch(model_type, mtp_layers=2)
    # The transformer layer of MTP layer 1 sits where the decoder layer after the last one would.
    proxy = bridge.mtp_proxy_name("mtp.layers.1.transformer_layer.mlp.linear_fc2.weight", arch.num_layers)
    assert proxy == "decoder.layers.3.mlp.linear_fc2.weight"
    assert (
        bridge.mtp_proxy_name("decoder.layers.1.mlp.linear_fc2.weight", 2)
        == "decoder.layers.1.mlp.linear_fc2.weight"
    )
    assert bridge.mtp_hf_name("model.layers.3.mlp.down_proj.weight", arch) == prefix + "mlp.down_proj.weight"
    assert (
        bridge.mtp_hf_name("model.layers.1.mlp.down_proj.weight", arch)
        == "model.layers.1.mlp.down_proj.weight"
    )
    own = {
        "mimo": ["token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"],
        "deepseek_v3": ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
        "glm4_moe": ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
        "glm4_moe_lite": ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
        "kimi_k2": ["enorm", "hnorm", "eh_proj", "shared_head.norm"],
    }[model_type]
    got = [
        bridge.mtp_own_hf_name(f"mtp.layers.1.{n}.weight", arch)
        for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")
    ]
    assert got == [f"{prefix}{n}.weight" for n in own]
    assert bridge.mtp_own_hf_name("mtp.layers.1.transformer_layer.input_layernorm.weight", arch) is None
    assert bridge.mtp_own_hf_name("decoder.final_layernorm.weight", arch) is None


def test_mimo_input_proj_halves_swap_into_megatron_order() -> None:
    w = torch.arange(24.0).view(3, 8)
    mimo = bridge.mtp_eh_proj_layout("mtp.layers.0.eh_proj.weight", w, _arch("mimo"))
    assert torch.equal(mimo[:, :4], w[:, 4:]) and torch.equal(mimo[:, 4:], w[:, :4])
    assert torch.equal(bridge.mtp_eh_proj_layout("mtp.layers.0.eh_proj.weight", mimo, _arch("mimo")), w)
    # DeepSeek's eh_proj already reads [enorm(e), hnorm(h)], as Megatron's does.
    assert bridge.mtp_eh_proj_layout("mtp.layers.0.eh_proj.weight", w, _arch("deepseek_v3")) is w


def test_mtp_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--enable-mtp-training"):
        MegatronConfig(enable_mtp_training=True)
    with pytest.raises(ConfigError, match="--mtp-num-layers"):
        MegatronConfig(mtp_num_layers=-1)
    assert MegatronConfig().mtp_loss_scaling_factor == 0.2  # slime's default
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=1"):
        check_mtp_layers(_arch("mimo"), 2)
    with pytest.raises(ConfigError, match="no multi-token-prediction layers"):
        check_mtp_layers(_arch("qwen2", mtp_layers=0), 1)
    check_mtp_layers(_arch("qwen2", mtp_layers=0), 0)
    check_mtp_layers(_arch("deepseek_v3", mtp_layers=2), 1)
    check_mtp_layers(_arch("glm4_moe_lite"), 1)  # GLM-4.7-Flash's one MTP layer (slime trains it)
    # A loss weight without the loss would be accepted and ignored.
    with pytest.raises(ConfigError, match="--mtp-loss-scaling-factor"):
        MegatronConfig(mtp_num_layers=1, mtp_loss_scaling_factor=0.5)
    # Through the architecture check `tether plan` runs against the HF config.
    with pytest.raises(ConfigError, match="--mtp-num-layers"):
        check_architecture_flags(_arch("mimo"), MegatronConfig(mtp_num_layers=3).architecture())


def test_mtp_flags_reach_the_transformer_config() -> None:
    flags = MegatronConfig(mtp_num_layers=1, enable_mtp_training=True, mtp_loss_scaling_factor=0.5)
    kw = megatron_args.mtp_config_kwargs(flags)
    assert kw == {"mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.5}
    assert megatron_args.mtp_config_kwargs(MegatronConfig(mtp_num_layers=0))["mtp_num_layers"] is None


def test_forward_inputs_align_labels_and_mask_with_the_logits() -> None:
    tokens = torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]])
    # Sample 0: prompt 5 6, response 7 8 (logits at 1, 2 predict them), the second one masked out.
    index = torch.tensor([1, 2, 5 + 2, 5 + 3])
    got = mtp.forward_inputs(tokens, index, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert got["labels"].tolist() == [[6, 7, 8, 0, 0], [2, 3, 4, 9, 0]]
    assert got["loss_mask"].tolist() == [[0, 1, 0, 0, 0], [0, 0, 1, 1, 0]]


# ---- a real tiny MiMo ----


@pytest.fixture(scope="module")
def one_rank() -> Iterator[Any]:
    import megatron.core.tensor_parallel.random as mrandom
    import torch.distributed as dist

    from tether.train.model import megatron_cpu
    from tether.train.parallel import topology as parallel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt  # noqa: F401
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # init_distributed patches torch for Megatron on CPU; other unit tests share this process.
    points: list[tuple[Any, str]] = [(torch, name) for name in megatron_cpu._FACTORIES]
    cuda = ("current_device", "manual_seed", "get_rng_state", "set_rng_state", "synchronize", "empty_cache")
    points += [(torch.cuda, n) for n in cuda]
    points += [(torch.cuda.random, "get_rng_state"), (torch.cuda.random, "set_rng_state")]
    points += [(torch.Tensor, n) for n in ("type", "to", "cuda", "pin_memory")]
    points += [(mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in points]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    topo = parallel.init_distributed(1, 1, seed=3)
    try:
        yield topo
    finally:
        parallel.destroy()
        for owner, name, value in originals:
            setattr(owner, name, value)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MiMo with every tensor perturbed (fresh norms are all ones, which would hide a swap)."""
    from safetensors.torch import load_file, save_file

    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("mimo") / "m", TinyModelSpec(arch="mimo", seed=4))
    f = path / "model.safetensors"
    g = torch.Generator().manual_seed(5)
    tensors = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in load_file(str(f)).items()}
    save_file(tensors, str(f), metadata={"format": "pt"})
    return path


def _build(one_rank: Any, hf: Path, **flags: Any) -> tuple[Any, Any]:
    from tether.train.model import build as tm

    opts = tm.ModelOptions(hf_checkpoint=str(hf), megatron=MegatronConfig(lr_decay_style="constant", **flags))
    train = bool(flags.get("enable_mtp_training"))
    arch, _config, chunk, weights = tm._prepare(opts, one_rank, train_mtp=train)
    tm.load_hf_weights([chunk], arch, hf, one_rank, weights)
    return chunk, weights


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    # Responses: positions 3..S-2 of each row predict trained tokens; one of them masked out.
    index = torch.cat([torch.arange(3, S - 1) + r * S for r in range(B)])
    loss_mask = torch.ones(index.numel())
    loss_mask[2] = 0.0
    return tokens, pos, mask, mtp.forward_inputs(tokens, index, loss_mask)


def test_mtp_tensors_round_trip_bit_exact(one_rank: Any, mimo_dir: Path) -> None:
    from safetensors.torch import load_file

    chunk, weights = _build(one_rank, mimo_dir, mtp_num_layers=1)
    source = load_file(str(mimo_dir / "model.safetensors"))
    out = dict(weights.export(chunk, bridge.Layout.current()))
    assert sorted(out) == sorted(source)  # every HF tensor, the MTP layer's included
    assert [n for n in out if not torch.equal(out[n], source[n])] == []
    assert any(n.startswith("model.mtp_layers.0.") for n in out)


def test_logits_do_not_change_with_the_mtp_block(one_rank: Any, mimo_dir: Path) -> None:
    plain, _ = _build(one_rank, mimo_dir)
    with_mtp, _ = _build(one_rank, mimo_dir, mtp_num_layers=1, enable_mtp_training=True)
    assert any(n.startswith("mtp.") for n, _ in with_mtp.named_parameters())
    tokens, pos, mask, extra = _inputs()
    plain.eval()
    with_mtp.eval()
    with torch.no_grad():
        want = plain(tokens, pos, mask)
        assert torch.equal(with_mtp(tokens, pos, mask), want)  # log-prob passes: no labels
        assert torch.equal(with_mtp(tokens, pos, mask, **extra), want)  # eval: the block does not run
    assert mtp.layer_losses(with_mtp) == []
    with_mtp.train()
    mtp.reset(with_mtp)
    assert torch.equal(with_mtp(tokens, pos, mask, **extra).detach(), want)  # training: same logits
    assert len(mtp.layer_losses(with_mtp)) == 1


def _reference_mtp_loss(hf: Path, tokens: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """MiMo's MTP layer 0 on transformers' Qwen2 modules with the checkpoint's tensors: at position t
    it reads the decoder's final hidden state h_t and the embedding of token t+1 and predicts token
    t+2 through the model's head; mean cross-entropy over the positions whose target is trained."""
    from safetensors.torch import load_file
    from support.hf_reference import load_causal_lm  # MiMo's decoder as Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

    lm = load_causal_lm(hf)
    cfg = lm.config
    w = load_file(str(hf / "model.safetensors"))
    p = "model.mtp_layers.0."

    def norm(name: str) -> Qwen2RMSNorm:
        n = Qwen2RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.data.copy_(w[p + name + ".weight"])
        return n

    layer = Qwen2DecoderLayer(cfg, layer_idx=0)
    layer.load_state_dict(
        {k[len(p) :]: v for k, v in w.items() if k.startswith(p) and "." in k[len(p) :]}, strict=False
    )
    layer.eval()
    with torch.no_grad():
        hidden = lm.model(tokens).last_hidden_state  # after the final norm, as Megatron hands it on
        nxt = torch.roll(tokens, -1, dims=1)
        nxt[:, -1] = 0
        emb = lm.model.embed_tokens(nxt)
        x = (
            torch.cat([norm("hidden_layernorm")(hidden), norm("token_layernorm")(emb)], dim=-1)
            @ w[p + "input_proj.weight"].T
        )
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        rope = Qwen2RotaryEmbedding(cfg)(x, pos)
        causal = torch.full((tokens.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        x = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=rope)
        x = x[0] if isinstance(x, tuple) else x
        logits = lm.lm_head(norm("final_layernorm")(x))
        target = torch.roll(tokens, -2, dims=1)
        target[:, -2:] = 0
        mask = torch.roll(loss_mask, -1, dims=1)
        mask[:, -1] = 0
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return float((ce * mask).sum() / mask.sum())


def test_mtp_loss_equals_mimos_mtp_layer(one_rank: Any, mimo_dir: Path) -> None:
    chunk, _ = _build(one_rank, mimo_dir, mtp_num_layers=1, enable_mtp_training=True)
    tokens, pos, mask, extra = _inputs()
    chunk.train()
    mtp.reset(chunk)
    with torch.no_grad():
        chunk(tokens, pos, mask, **extra)
    (got,) = mtp.layer_losses(chunk)
    assert got == pytest.approx(_reference_mtp_loss(mimo_dir, tokens, extra["loss_mask"]), abs=1e-5)


def _grads(chunk: Any, tokens: Any, pos: Any, mask: Any, extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    chunk.train()
    chunk.zero_grad()
    logits = chunk(tokens, pos, mask, **extra)
    logits.float().logsumexp(-1).mean().backward()  # a stand-in main loss on the logits
    return {n: p.grad.clone() for n, p in chunk.named_parameters() if p.grad is not None}


def test_mtp_loss_trains_the_mtp_layer_and_the_decoder_not_the_head(one_rank: Any, mimo_dir: Path) -> None:
    tokens, pos, mask, extra = _inputs()
    plain, _ = _build(one_rank, mimo_dir)
    want = _grads(plain, tokens, pos, mask, {})
    trained, _ = _build(one_rank, mimo_dir, mtp_num_layers=1, enable_mtp_training=True)
    got = _grads(trained, tokens, pos, mask, extra)
    mtp_params = [n for n, _ in trained.named_parameters() if mtp.is_mtp_param(n)]
    assert mtp_params and all(got[n].abs().sum() > 0 for n in mtp_params)
    # The MTP logits use a detached head (slime's patch): the output layer's gradient is the main loss's.
    assert torch.equal(got["output_layer.weight"], want["output_layer.weight"])
    # The MTP loss reaches the decoder through its hidden states (and the embedding through both).
    assert not torch.allclose(
        got["decoder.layers.0.mlp.linear_fc2.weight"], want["decoder.layers.0.mlp.linear_fc2.weight"]
    )
    # With --mtp-loss-scaling-factor 0 the decoder's gradients are the main loss's alone.
    zero, _ = _build(
        one_rank, mimo_dir, mtp_num_layers=1, enable_mtp_training=True, mtp_loss_scaling_factor=0.0
    )
    got0 = _grads(zero, tokens, pos, mask, extra)
    for name, grad in want.items():
        torch.testing.assert_close(got0[name], grad, rtol=0, atol=1e-6)


def test_without_mtp_training_the_block_is_frozen_and_not_run(one_rank: Any, mimo_dir: Path) -> None:
    chunk, _ = _build(one_rank, mimo_dir, mtp_num_layers=1)
    frozen = mtp.freeze(chunk)
    assert frozen == len([n for n, _ in chunk.named_parameters() if n.startswith("mtp.")]) > 0
    assert mtp.training_model(chunk) is None  # so the step passes it no labels
    tokens, pos, mask, extra = _inputs()
    chunk.train()
    chunk(tokens, pos, mask, **extra).float().sum().backward()
    assert all(p.grad is None for n, p in chunk.named_parameters() if n.startswith("mtp."))
    assert mtp.layer_losses(chunk) == []


def test_tiny_mimo_config_names_its_mtp_layers(mimo_dir: Path) -> None:
    from tether.train.model.hf_config import load_arch

    assert json.loads((mimo_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert load_arch(mimo_dir).mtp_layers == 1


def test_routing_replay_with_mtp_layers_is_refused() -> None:
    from tether.train.config import AlgorithmConfig, check_routing_replay

    algo = AlgorithmConfig(use_routing_replay=True)
    with pytest.raises(ConfigError, match="--mtp-num-layers"):
        check_routing_replay(algo, MegatronConfig(mtp_num_layers=1, num_experts=4), None)
    check_routing_replay(algo, MegatronConfig(num_experts=4), None)
