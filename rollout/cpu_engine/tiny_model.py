"""`tether init-model`: write a small, randomly initialised Hugging Face model directory.

Nothing is fetched from a model hub: the tokenizer is a byte-level BPE trained here, on a
built-in corpus, with `tokenizers`; the weights come from transformers' own initialisation
under a fixed seed. transformers, SGLang, the embedded CPU engine and the trainer all load
the result.

Defaults (chosen so the CPU demo and the tests are fast): Llama, hidden 64, 2 layers, 4
attention heads and 2 KV heads (head dim 16, GQA), FFN 128, vocabulary padded to 320,
context 2048, RoPE theta 10000, untied embeddings, float32 safetensors.
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

from tether.runtime.atomic_file import fsync_path
from tether.runtime.errors import ConfigError

Arch = Literal["llama", "qwen2", "qwen3"]

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
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 320
    max_position: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    seed: int = 0
    bpe_merges: int = 48

    def __post_init__(self) -> None:
        for key, value in (
            ("--hidden", self.hidden),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--intermediate", self.intermediate),
            ("--max-position", self.max_position),
        ):
            if value < 1:
                raise ConfigError(key, value, "must be at least 1")
        if self.hidden % self.heads:
            raise ConfigError("--hidden", self.hidden, f"must be divisible by --heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ConfigError("--kv-heads", self.kv_heads, f"must divide --heads ({self.heads})")
        if self.bpe_merges < 0:
            raise ConfigError("--bpe-merges", self.bpe_merges, "must be at least 0")
        minimum = 256 + len(SPECIAL_TOKENS) + self.bpe_merges
        if self.vocab < minimum:
            raise ConfigError(
                "--vocab", self.vocab, f"must be at least {minimum} (bytes + specials + merges)"
            )


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
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    head_dim = spec.hidden // spec.heads
    common: dict[str, Any] = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": spec.max_position,
        "bos_token_id": tokenizer.bos_token_id,  # type: ignore[attr-defined]
        "eos_token_id": tokenizer.eos_token_id,  # type: ignore[attr-defined]
        "pad_token_id": tokenizer.pad_token_id,  # type: ignore[attr-defined]
        "tie_word_embeddings": spec.tie_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "dtype": "float32",
    }
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(**common)


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
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
        GenerationConfig(
            bos_token_id=config.bos_token_id,  # type: ignore[attr-defined]
            eos_token_id=config.eos_token_id,  # type: ignore[attr-defined]
            pad_token_id=config.pad_token_id,  # type: ignore[attr-defined]
        ).save_pretrained(staging)
        _write_atomically(staging, out_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TinyModelSpec()
    parser.add_argument("--out", required=True, help="Directory to write the model into.")
    parser.add_argument("--arch", choices=["llama", "qwen2", "qwen3"], default=d.arch, help="Model family.")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="Hidden size.")
    parser.add_argument("--layers", type=int, default=d.layers, help="Number of decoder layers.")
    parser.add_argument("--heads", type=int, default=d.heads, help="Attention heads.")
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads, help="Key/value heads (GQA).")
    parser.add_argument("--intermediate", type=int, default=d.intermediate, help="FFN (SwiGLU) size.")
    parser.add_argument("--vocab", type=int, default=d.vocab, help="Vocabulary size (padded).")
    parser.add_argument("--max-position", type=int, default=d.max_position, help="Context length.")
    parser.add_argument("--rope-theta", type=float, default=d.rope_theta, help="RoPE base.")
    parser.add_argument("--tie-embeddings", action="store_true", help="Tie lm_head to the embeddings.")
    parser.add_argument("--seed", type=int, default=d.seed, help="Seed for the random weights.")
    parser.add_argument("--bpe-merges", type=int, default=d.bpe_merges, help="BPE merges learned.")


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
    )
    out = write_tiny_model(args.out, spec)
    config = json.loads((out / "config.json").read_text())
    print(json.dumps({"out": str(out), "arch": spec.arch, "model_type": config.get("model_type")}))
    return 0
