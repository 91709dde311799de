"""`tether init-model`: write a small, randomly initialised Hugging Face model directory.

Nothing is fetched from a model hub: the tokenizer is a byte-level BPE trained here, on a
built-in corpus, with `tokenizers`; the weights come from transformers' own initialisation
under a fixed seed. transformers, SGLang, the embedded CPU engine and the trainer all load
the result.

Defaults (chosen so the CPU demo and the tests are fast): Llama, hidden 64, 2 layers, 4
attention heads and 2 KV heads (head dim 16, GQA), FFN 128, vocabulary padded to 320,
context 2048, RoPE theta 10000, untied embeddings, float32 safetensors.

Mixture-of-Experts families (qwen2_moe, qwen3_moe, mixtral, deepseek_v3, glm4_moe_lite, kimi_k2,
glm4_moe, minimax_m2, glm_moe_dsa, deepseek_v32) get 4 routed experts, top-2, each expert's FFN a quarter of --intermediate;
minimax_m2 rotates half of each head (rotary_dim) and its config.json carries the keys MiniMax's own
does (scoring_func, use_routing_bias, use_qk_norm, qk_norm_type); deepseek_v3, glm4_moe_lite,
kimi_k2 and glm4_moe keep their first layer dense (first_k_dense_replace=1; glm4_moe_lite's
mlp_layer_types too) and add one shared expert; qwen2_moe adds its gated shared expert (FFN half
of --intermediate). deepseek_v3 uses multi-latent attention sized from the head dim d =
hidden/heads: q_lora_rank hidden/2, kv_lora_rank hidden/4, qk_nope d, qk_rope d/2, v d; 2 expert
groups with 1 chosen (noaux_tc). kimi_k2 is deepseek_v3's model saved as Kimi-K2's config.json
names it (model_type kimi_k2, architectures DeepseekV3ForCausalLM); glm4_moe_lite (GLM-4.7-Flash)
has the same attention with a value dim of 2d, one expert group and routed_scaling_factor 1.8.
Routers are re-drawn wider than transformers' init, and the score-correction biases (zero after
transformers' init) get random values, so routing depends on the token and on the bias.

qwen3_next (Qwen3-Next) alternates linear attention (gated delta net: key heads --kv-heads,
value heads --heads, both of the head dim, conv kernel 4) and full attention with an output
gate (full_attention_interval 2), rotates a quarter of each head, and adds a sigmoid-gated shared
expert (FFN half of --intermediate); its zero-centred norm weights are drawn around 0 (and the
linear layers' output norms around 1) instead of transformers' constant init.

qwen3_5 and qwen3_5_moe (Qwen3.5) are written as Qwen3.5 is published: a vision-language
checkpoint (Qwen3_5ForConditionalGeneration: the decoder's config under text_config, its tensors
under model.language_model., a one-block vision tower under model.visual.) with two MTP tensors
under mtp.*; the decoder is qwen3_next's with linear attention's projections apart (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a), a dense MLP (qwen3_5) or qwen3_next's experts stored fused
(experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]: qwen3_5_moe).

glm_moe_dsa (GLM-5) and deepseek_v32 (DeepSeek-V3.2) are deepseek_v3's model (glm_moe_dsa with one
expert group) plus DeepSeek sparse attention's indexer on every layer: 16 indexer heads of the head
dim d (twice qk_rope), index_topk --index-topk (default 4, so prompts of a few tokens already attend
sparsely); the indexer's key norm weights and biases are drawn around 1 and 0, and the pad token's
embedding like any other (not zeros: see _vary_indexer_init). glm_moe_dsa runs its
indexer on layer 0 and then every --index-topk-freq-th layer (default 2; transformers'
index_topk_freq with index_skip_topk_offset 1), the other layers sharing the last one's choice
("shared" in indexer_types): four layers are full, shared, full, shared, so a two-stage pipeline
starts each stage with an indexer; 1 gives every layer its own.

Multi-token-prediction layers (--mtp-layers N; deepseek_v3, glm4_moe_lite, kimi_k2 and glm4_moe,
default 0; mimo, which is Qwen2 plus MTP layers, default 1): each is a decoder layer of the family
with its own norms and input projection, under the family's HF names (DeepSeek-V3 and its kin,
GLM-4.5: model.layers.{L+i}.* with enorm, hnorm, eh_proj, shared_head and embed_tokens; MiMo:
model.mtp_layers.{i}.* with token_layernorm, hidden_layernorm, input_proj, final_layernorm), and
num_nextn_predict_layers N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import msgspec

from tether.rollout.cpu_engine.modeling.families import DSA_MODEL_TYPES, MLA_MODEL_TYPES
from tether.runtime.errors import ConfigError
from tether.runtime.files.atomic_file import fsync_path

Arch = Literal[
    "llama",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "glm4",
    "glm4_moe",
    "mimo",
    "minimax_m2",
    "glm4_moe_lite",
    "kimi_k2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "glm_moe_dsa",
    "deepseek_v32",
]
ARCHES: tuple[str, ...] = Arch.__args__  # type: ignore[attr-defined]
MOE_ARCHES = frozenset(
    {
        "qwen2_moe",
        "qwen3_moe",
        "mixtral",
        "glm4_moe",
        "minimax_m2",
        "qwen3_next",
        "qwen3_5_moe",
        *MLA_MODEL_TYPES,
    }
)
# Gated-delta-net families: zero-centred norms (drawn around 0 here, see _vary_norms).
_GDN_ARCHES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe"})
# Published as vision-language checkpoints (decoder under text_config and model.language_model.).
_VL_ARCHES = frozenset({"qwen3_5", "qwen3_5_moe"})
# Families whose first layer stays dense (first_k_dense_replace=1): they need a second layer.
_DENSE_FIRST = frozenset({"glm4_moe", *MLA_MODEL_TYPES})
# Families whose checkpoints carry multi-token-prediction layers (--mtp-layers); MiMo always has.
MTP_ARCHES = frozenset({"glm4_moe", "mimo", *MLA_MODEL_TYPES}) - frozenset(DSA_MODEL_TYPES)
TINY_EXPERTS = 4
# DSA's indexer heads: with few heads many keys score exactly 0 (every head's relu is 0) and which
# of equal scores makes the top-k is arbitrary (transformers' cached decode and its full forward
# can disagree); 16 heads make such ties at the top-k's edge rare enough for exact comparisons.
TINY_INDEX_HEADS = 16
TINY_EXPERTS_PER_TOKEN = 2

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
# ChatML, with tools and tool calls rendered as Qwen 2.5 does (SGLang's `qwen25` parser reads
# the calls back): the tools in a system block, an assistant's calls as <tool_call> blocks, tool
# results as <tool_response> blocks in a user turn. transformers renders with trim_blocks, so a
# newline right after a block tag is written as {{ '\n' }}.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures, within <tools></tools>:\n"
    "<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "Return each call as a JSON object within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for call in m.get('tool_calls') or [] %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A handful of merges learned from this corpus keep common words short; the 256-byte alphabet
# covers every input, so no text is ever out of vocabulary.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world. What is 2+3? The answer is 5.",
    "Sort the digits: 4 1 3 2 -> 1 2 3 4",
    "user assistant system question answer",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 = + - * /",
]


class TinyModelSpec(msgspec.Struct, kw_only=True, frozen=True):
    """The shape of a tiny model; every field maps onto a `tether init-model` flag."""

    arch: Arch = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    # None: 2 (GQA) for families with KV heads; multi-latent attention (MLA_MODEL_TYPES) has none.
    kv_heads: int | None = None
    intermediate: int = 128
    vocab: int = 320
    max_position: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    seed: int = 0
    bpe_merges: int = 48
    # Multi-token-prediction layers in the checkpoint (num_nextn_predict_layers); None: 1 for mimo,
    # else 0. DeepSeek-V3/GLM-4.5 number them after the decoder layers, MiMo has model.mtp_layers.
    mtp_layers: int | None = None
    # DeepSeek sparse attention (DSA_MODEL_TYPES): keys each query attends to; for glm_moe_dsa, every
    # how many layers (after the first two) run an indexer (None: 2), the rest sharing its choice.
    index_topk: int = 4
    index_topk_freq: int | None = None

    def __post_init__(self) -> None:
        for key, value in (
            ("--hidden", self.hidden),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--kv-heads", self.num_kv_heads),
            ("--intermediate", self.intermediate),
            ("--max-position", self.max_position),
        ):
            if value < 1:
                raise ConfigError(key, value, "must be at least 1")
        if self.hidden % self.heads:
            raise ConfigError("--hidden", self.hidden, f"must be divisible by --heads ({self.heads})")
        if self.arch in MLA_MODEL_TYPES:
            if self.kv_heads is not None and self.kv_heads != self.heads:
                raise ConfigError(
                    "--kv-heads", self.kv_heads, f"multi-latent attention ({self.arch}) has no KV heads"
                )
            if (self.hidden // self.heads) % 2:
                raise ConfigError("--heads", self.heads, f"{self.arch} needs an even head dim")
        elif self.heads % self.num_kv_heads:
            raise ConfigError("--kv-heads", self.kv_heads, f"must divide --heads ({self.heads})")
        if self.arch in MOE_ARCHES and self.intermediate % 4:
            raise ConfigError(
                "--intermediate", self.intermediate, "must be divisible by 4 (experts use a quarter)"
            )
        if self.arch in _DENSE_FIRST and self.layers < 2:
            raise ConfigError(
                "--layers", self.layers, f"{self.arch} keeps layer 0 dense; it needs at least 2"
            )
        if self.num_mtp_layers < 0:
            raise ConfigError("--mtp-layers", self.mtp_layers, "must be at least 0")
        if self.num_mtp_layers and self.arch not in MTP_ARCHES:
            raise ConfigError(
                "--mtp-layers", self.mtp_layers, f"only {', '.join(sorted(MTP_ARCHES))} carry MTP layers"
            )
        if self.arch == "mimo" and not self.num_mtp_layers:
            raise ConfigError("--mtp-layers", self.mtp_layers, "a MiMo model has at least one MTP layer")
        if self.index_topk < 1:
            raise ConfigError("--index-topk", self.index_topk, "must be at least 1")
        if self.index_topk_freq is not None:
            if self.arch != "glm_moe_dsa":
                raise ConfigError(
                    "--index-topk-freq",
                    self.index_topk_freq,
                    "only glm_moe_dsa shares indexers between layers",
                )
            if self.index_topk_freq < 1:
                raise ConfigError("--index-topk-freq", self.index_topk_freq, "must be at least 1")
        if self.bpe_merges < 0:
            raise ConfigError("--bpe-merges", self.bpe_merges, "must be at least 0")
        minimum = 256 + len(SPECIAL_TOKENS) + self.bpe_merges
        if self.vocab < minimum:
            raise ConfigError(
                "--vocab", self.vocab, f"must be at least {minimum} (bytes + specials + merges)"
            )

    @property
    def num_mtp_layers(self) -> int:
        if self.mtp_layers is None:
            return 1 if self.arch == "mimo" else 0
        return self.mtp_layers

    @property
    def num_kv_heads(self) -> int:
        if self.arch in MLA_MODEL_TYPES:
            return self.heads
        return 2 if self.kv_heads is None else self.kv_heads


def build_tokenizer(merges: int) -> object:
    """A byte-level BPE tokenizer (a transformers PreTrainedTokenizerFast) trained locally."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(SPECIAL_TOKENS) + merges,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 8, trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _hf_config(spec: TinyModelSpec, tokenizer: object) -> object:
    import transformers

    head_dim = spec.hidden // spec.heads
    common: dict[str, Any] = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": spec.max_position,
        "bos_token_id": tokenizer.bos_token_id,  # type: ignore[attr-defined]
        "eos_token_id": tokenizer.eos_token_id,  # type: ignore[attr-defined]
        "pad_token_id": tokenizer.pad_token_id,  # type: ignore[attr-defined]
        "tie_word_embeddings": spec.tie_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "dtype": "float32",
    }
    if spec.arch not in MLA_MODEL_TYPES:
        common["head_dim"] = head_dim
    expert_ffn = spec.intermediate // 4
    moe: dict[str, Any] = {"num_experts_per_tok": TINY_EXPERTS_PER_TOKEN}
    arch = spec.arch
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch in ("qwen2", "mimo"):  # MiMo's decoder is Qwen2's (its MTP layers are added after)
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common)
    if arch == "glm4":
        return transformers.Glm4Config(**common)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            **moe,
            num_experts=TINY_EXPERTS,
            moe_intermediate_size=expert_ffn,
            shared_expert_intermediate_size=spec.intermediate // 2,
            norm_topk_prob=False,
        )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, **moe, num_experts=TINY_EXPERTS, moe_intermediate_size=expert_ffn, norm_topk_prob=True
        )
    if arch == "qwen3_next":
        # Linear attention (gated delta net) on every other layer, full attention with an output
        # gate on the rest; a quarter of each head rotated; a sigmoid-gated shared expert.
        return transformers.Qwen3NextConfig(
            **common,
            **moe,
            num_experts=TINY_EXPERTS,
            moe_intermediate_size=expert_ffn,
            shared_expert_intermediate_size=spec.intermediate // 2,
            norm_topk_prob=True,
            # What full_attention_interval=2 gives, stated as the saved config.json states it.
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)],
            linear_num_key_heads=spec.num_kv_heads,
            linear_num_value_heads=spec.heads,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4,
        )
    if arch in _VL_ARCHES:
        return _qwen3_5_config(spec, common, moe, expert_ffn)
    if arch == "mixtral":
        common["intermediate_size"] = expert_ffn
        return transformers.MixtralConfig(**common, **moe, num_local_experts=TINY_EXPERTS)
    if arch == "minimax_m2":
        # sigmoid routing with a correction bias, QK norms over all heads, half the head rotary
        common["intermediate_size"] = expert_ffn
        rotary: dict[str, Any] = {"rotary_dim": head_dim // 2}  # MiniMax's key; the config derives the factor
        return transformers.MiniMaxM2Config(**common, **moe, **rotary, num_local_experts=TINY_EXPERTS)
    if arch == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common,
            **moe,
            n_routed_experts=TINY_EXPERTS,
            n_shared_experts=1,
            moe_intermediate_size=expert_ffn,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.5,
            attention_bias=True,
            num_mtp_layers=spec.num_mtp_layers,
        )
    mla: dict[str, Any] = {
        "q_lora_rank": spec.hidden // 2,
        "kv_lora_rank": spec.hidden // 4,
        "qk_nope_head_dim": head_dim,
        "qk_rope_head_dim": head_dim // 2,
    }
    if arch in DSA_MODEL_TYPES:
        return _dsa_config(spec, common, moe, mla, expert_ffn)
    if arch == "glm4_moe_lite":
        # GLM-4.7-Flash: DeepSeek-V3's attention (values wider than the query's nope part, as its 256 to 192),
        # GLM-4.5's router with one group; transformers lists the dense layers as mlp_layer_types.
        return transformers.Glm4MoeLiteConfig(
            **common,
            **moe,
            **mla,
            v_head_dim=2 * head_dim,
            n_routed_experts=TINY_EXPERTS,
            n_shared_experts=1,
            moe_intermediate_size=expert_ffn,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.8,
        )
    # deepseek_v3 (and kimi_k2, its config.json relabelled): multi-latent attention + grouped,
    # biased sigmoid routing.
    return transformers.DeepseekV3Config(
        **common,
        **moe,
        n_routed_experts=TINY_EXPERTS,
        n_shared_experts=1,
        moe_intermediate_size=expert_ffn,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        **mla,
        v_head_dim=head_dim,
        num_mtp_layers=spec.num_mtp_layers,
    )


def _dsa_config(
    spec: TinyModelSpec, common: dict[str, Any], moe: dict[str, Any], mla: dict[str, Any], expert_ffn: int
) -> object:
    """GLM-5 / DeepSeek-V3.2: deepseek_v3's model with an indexer per layer (GLM-5's shared on the
    layers index_topk_freq skips)."""
    import transformers

    head_dim = spec.hidden // spec.heads
    kwargs: dict[str, Any] = {
        **common,
        **moe,
        **mla,
        "v_head_dim": head_dim,
        "n_routed_experts": TINY_EXPERTS,
        "n_shared_experts": 1,
        "moe_intermediate_size": expert_ffn,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "index_n_heads": TINY_INDEX_HEADS,
        "index_head_dim": head_dim,  # twice qk_rope_head_dim: half of it rotated
        "index_topk": spec.index_topk,
    }
    if spec.arch == "deepseek_v32":
        return transformers.DeepseekV32Config(**kwargs, n_group=2, topk_group=1)
    # Keys transformers' config reads in __post_init__ to derive indexer_types (the list is saved).
    kwargs["index_topk_freq"] = 2 if spec.index_topk_freq is None else spec.index_topk_freq
    kwargs["index_skip_topk_offset"] = 1
    return transformers.GlmMoeDsaConfig(**kwargs, n_group=1, topk_group=1)


def _vary_indexer_init(model: Any, seed: int, pad_token_id: int) -> None:
    """The indexer's key LayerNorm starts at weight 1, bias 0: drawn around those, so a forward that
    left out the norm's affine part would differ. The pad token's embedding (zeros after init) is
    drawn like the others: a zero input gives the indexer zero head weights, so every key would score
    alike for it and its top-k would be an arbitrary pick among ties."""
    import torch

    gen = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if ".indexer.k_norm." in name:
                base = 1.0 if name.endswith(".weight") else 0.0
                tensor.copy_(base + torch.randn(tensor.shape, generator=gen) * 0.1)
        embed = model.get_input_embeddings().weight
        embed[pad_token_id] = torch.randn(embed.shape[1], generator=gen) * float(embed.std())


def _qwen3_5_config(
    spec: TinyModelSpec, common: dict[str, Any], moe: dict[str, Any], expert_ffn: int
) -> object:
    """Qwen3.5 as published: a vision-language config, the decoder (Qwen3-Next's layers, linear
    attention every other layer) under text_config beside a one-block vision tower."""
    import transformers

    head_dim = spec.hidden // spec.heads
    text = {
        **{k: v for k, v in common.items() if k not in ("tie_word_embeddings", "dtype", "rope_theta")},
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": 0.25,
        },
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)],
        "linear_num_key_heads": spec.num_kv_heads,
        "linear_num_value_heads": spec.heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": spec.hidden,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if spec.arch == "qwen3_5":
        return transformers.Qwen3_5Config(
            text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_embeddings
        )
    del text["intermediate_size"]  # every layer is MoE: the text config has no dense FFN
    text |= {
        **moe,
        "num_experts": TINY_EXPERTS,
        "moe_intermediate_size": expert_ffn,
        "shared_expert_intermediate_size": spec.intermediate // 2,
    }
    return transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_embeddings
    )


def _as_published_qwen3_5(spec: TinyModelSpec, staging: Path) -> None:
    """Rewrite transformers' save into the published form: routed experts fused (experts.gate_up_proj
    [E, 2I, H], experts.down_proj [E, H, I]) and an MTP module's tensors under mtp.* (which
    transformers' model does not load; the trainer and the engines keep them aside)."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(staging / "model.safetensors"))
    tensors: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for name, tensor in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            tensors[name] = tensor
            continue
        index, proj, _ = tail.split(".")
        experts.setdefault(head + ".mlp.experts.", {}).setdefault(int(index), {})[proj] = tensor
    for prefix, by_index in experts.items():
        order = [by_index[e] for e in sorted(by_index)]
        tensors[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat((p["gate_proj"], p["up_proj"])) for p in order]
        )
        tensors[prefix + "down_proj"] = torch.stack([p["down_proj"] for p in order])
    gen = torch.Generator().manual_seed(spec.seed + 4)
    tensors["mtp.fc.weight"] = torch.randn(spec.hidden, 2 * spec.hidden, generator=gen) * 0.02
    tensors["mtp.norm.weight"] = torch.randn(spec.hidden, generator=gen) * 0.1
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})


MINIMAX_M2_CONFIG_KEYS: dict[str, Any] = {
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "num_mtp_modules": 0,
}
"""Keys MiniMax-M2's published config.json carries that transformers' config does not write (SGLang
reads them; transformers' model always routes and normalizes this way)."""
# Kimi-K2's config.json is DeepSeek-V3's under its own model_type (its checkpoints ship remote code).
KIMI_K2_CONFIG_KEYS: dict[str, Any] = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
# GLM-4.7-Flash's config.json states its dense layers both ways (transformers reads mlp_layer_types).
GLM4_MOE_LITE_CONFIG_KEYS: dict[str, Any] = {"first_k_dense_replace": 1}


def _add_config_keys(staging: Path, keys: dict[str, Any]) -> None:
    path = staging / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **keys}, indent=2, sort_keys=True) + "\n")


def _spread_routing(model: Any, seed: int) -> None:
    """Widen router weights and give score-correction biases non-zero values.

    transformers draws routers with std 0.02 and zeroes the correction bias; at these tiny
    shapes that routes nearly every token alike and would hide a bias the engine forgets.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                fan_in = tensor.shape[-1]
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * (2.0 / fan_in**0.5))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)


def _vary_norms(model: Any, seed: int) -> None:
    """Qwen3-Next's norms scale by (1 + weight) from weight 0 (the gated delta net's output norm
    by its weight, from 1): drawn around those, so a forward that forgot the offset would differ."""
    import torch

    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if name.endswith("norm.weight") and ".visual." not in name:
                base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                tensor.copy_(base + torch.randn(tensor.shape, generator=gen) * 0.1)


def _add_mtp_layers(spec: TinyModelSpec, staging: Path) -> None:
    """Rewrite a checkpoint saved with spec.layers + N decoder layers into one with N MTP layers:
    its last N layers become the MTP layers' transformer layers, under the family's names, with
    each MTP layer's own norms and projection added; config.json says N num_nextn_predict_layers."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(staging / "model.safetensors"))
    raw = json.loads((staging / "config.json").read_text())
    layers, n, hidden = spec.layers, spec.num_mtp_layers, spec.hidden
    gen = torch.Generator().manual_seed(spec.seed + 2)
    tensors: dict[str, Any] = {}
    for name, tensor in state.items():
        parts = name.split(".", 3)
        if spec.arch == "mimo" and parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
            name = f"model.mtp_layers.{int(parts[2]) - layers}.{parts[3]}"
        tensors[name] = tensor
    embed, head = (
        state["model.embed_tokens.weight"],
        state.get("lm_head.weight", state["model.embed_tokens.weight"]),
    )
    for i in range(n):
        eh_proj = torch.randn(hidden, 2 * hidden, generator=gen) * 0.02
        if spec.arch == "mimo":  # MiMo's names (mbridge's mimo bridge)
            p = f"model.mtp_layers.{i}."
            tensors |= {
                p + "token_layernorm.weight": torch.ones(hidden),
                p + "hidden_layernorm.weight": torch.ones(hidden),
                p + "input_proj.weight": eh_proj,
                p + "final_layernorm.weight": torch.ones(hidden),
            }
        else:  # DeepSeek-V3 / GLM-4.5: the layer after the decoder's, with its own embedding and head
            p = f"model.layers.{layers + i}."
            tensors |= {
                p + "enorm.weight": torch.ones(hidden),
                p + "hnorm.weight": torch.ones(hidden),
                p + "eh_proj.weight": eh_proj,
                p + "shared_head.norm.weight": torch.ones(hidden),
                p + "embed_tokens.weight": embed.clone(),
                p + "shared_head.head.weight": head.clone(),
            }
    raw["num_hidden_layers"] = layers
    raw["num_nextn_predict_layers"] = n
    raw.pop("num_mtp_layers", None)
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists follow the decoder's length
        if isinstance(raw.get(key), list):
            raw[key] = raw[key][:layers]
    if spec.arch == "mimo":
        raw["model_type"] = "mimo"
        raw["architectures"] = ["MiMoForCausalLM"]
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _write_atomically(staging: Path, out: Path) -> None:
    """Move each staged file into `out` with os.replace, so no file is ever half-written."""
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(staging.iterdir()):
        os.chmod(entry, 0o644)  # some writers create 0600 temp files; the model is shared read-only
        fsync_path(entry)
        os.replace(entry, out / entry.name)
    fsync_path(out)


def write_tiny_model(out: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec or TinyModelSpec()
    out_path = Path(out)
    tokenizer = build_tokenizer(spec.bpe_merges)
    config = _hf_config(spec, tokenizer)
    mtp = spec.num_mtp_layers
    if mtp:  # built with the MTP layers' transformer layers as extra decoder layers (_mtp_checkpoint)
        config.num_hidden_layers = spec.layers + mtp  # type: ignore[attr-defined]
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = [config.layer_types[0]] * (spec.layers + mtp)  # type: ignore[attr-defined]
        if isinstance(getattr(config, "mlp_layer_types", None), list):  # an MTP layer's block is MoE
            config.mlp_layer_types = [*config.mlp_layer_types, *["sparse"] * mtp]  # type: ignore[attr-defined]
    torch.manual_seed(spec.seed)
    if spec.arch in _VL_ARCHES:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.arch in MOE_ARCHES:
        _spread_routing(model, spec.seed)
    if spec.arch in _GDN_ARCHES:
        _vary_norms(model, spec.seed)
    if spec.arch in DSA_MODEL_TYPES:
        _vary_indexer_init(model, spec.seed, tokenizer.pad_token_id)  # type: ignore[attr-defined]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if spec.arch == "minimax_m2":
            _add_config_keys(staging, MINIMAX_M2_CONFIG_KEYS)
        if spec.arch == "kimi_k2":
            _add_config_keys(staging, KIMI_K2_CONFIG_KEYS)
        if spec.arch == "glm4_moe_lite":
            _add_config_keys(staging, GLM4_MOE_LITE_CONFIG_KEYS)
        if mtp:
            _add_mtp_layers(spec, staging)
        if spec.arch in _VL_ARCHES:
            _as_published_qwen3_5(spec, staging)
        tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
            eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
            pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        ).save_pretrained(staging)
        _write_atomically(staging, out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TinyModelSpec()
    parser.add_argument("--out", required=True, help="Directory to write the model into.")
    parser.add_argument("--arch", choices=list(ARCHES), default=d.arch, help="Model family.")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="Hidden size.")
    parser.add_argument("--layers", type=int, default=d.layers, help="Number of decoder layers.")
    parser.add_argument("--heads", type=int, default=d.heads, help="Attention heads.")
    parser.add_argument(
        "--kv-heads", type=int, default=d.kv_heads, help="Key/value heads (GQA; default 2, none for MLA)."
    )
    parser.add_argument("--intermediate", type=int, default=d.intermediate, help="FFN (SwiGLU) size.")
    parser.add_argument("--vocab", type=int, default=d.vocab, help="Vocabulary size (padded).")
    parser.add_argument("--max-position", type=int, default=d.max_position, help="Context length.")
    parser.add_argument("--rope-theta", type=float, default=d.rope_theta, help="RoPE base.")
    parser.add_argument("--tie-embeddings", action="store_true", help="Tie lm_head to the embeddings.")
    parser.add_argument("--seed", type=int, default=d.seed, help="Seed for the random weights.")
    parser.add_argument("--bpe-merges", type=int, default=d.bpe_merges, help="BPE merges learned.")
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        help="Multi-token-prediction layers in the checkpoint (deepseek_v3, glm4_moe_lite, kimi_k2, "
        "glm4_moe, mimo; default 1 for mimo, else 0).",
    )
    parser.add_argument(
        "--index-topk",
        type=int,
        default=d.index_topk,
        help="Keys each query attends to (glm_moe_dsa, deepseek_v32: index_topk).",
    )
    parser.add_argument(
        "--index-topk-freq",
        type=int,
        default=None,
        help="glm_moe_dsa: after layers 0 and 1, every how many layers run an indexer; the others "
        "share the last one's choice (default 2; 1: every layer its own).",
    )


def main(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(
        arch=args.arch,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        max_position=args.max_position,
        rope_theta=args.rope_theta,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
        bpe_merges=args.bpe_merges,
        mtp_layers=args.mtp_layers,
        index_topk=args.index_topk,
        index_topk_freq=args.index_topk_freq,
    )
    try:
        out = write_tiny_model(args.out, spec)
    except OSError as exc:  # named by its flag: the temporary sibling in the message means nothing
        raise ConfigError("--out", str(args.out), f"cannot be written: {exc.strerror or exc}") from exc
    config = json.loads((out / "config.json").read_text())
    print(json.dumps({"out": str(out), "arch": spec.arch, "model_type": config.get("model_type")}))
    return 0
