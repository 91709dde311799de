"""The tokenizer class AutoTokenizer picks, remembered between runs (rollout/data/tokenizer_choice.py):
a remembered class builds the tokenizer AutoTokenizer builds; any change to the files, another
transformers version, a model's own code, a path AutoTokenizer treats by its name, a broken or
switched-off cache asks AutoTokenizer again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers import AutoTokenizer

from tether.rollout.data import tokenizer_choice as choice
from tether.runtime.files.cache_dir import CACHE_ENV, cache_dir

VERSION = str(transformers.__version__)
TEXTS = ["hello world, 12 + 7 = 19", "  two  spaces\tand a tab\n", "ünïcödé ✓"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(where))
    return where


def variant(tiny_model: Path, where: Path, tokenizer_class: str | None, model_type: str = "llama") -> Path:
    """The tiny model's tokenizer files under another declared class and model type."""
    out = where / f"{model_type}-{tokenizer_class}"
    out.mkdir(parents=True)
    for f in tiny_model.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tc["tokenizer_class"] = tokenizer_class
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    cfg = json.loads((out / "config.json").read_text())
    cfg["model_type"] = model_type
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def behaviour(tok: Any) -> dict[str, Any]:
    return {
        "class": type(tok),
        "init_kwargs": {k: str(v) for k, v in tok.init_kwargs.items()},
        "vocab": tok.get_vocab(),
        "special": tok.all_special_tokens,
        "ids": [tok(t)["input_ids"] for t in TEXTS],
        "decoded": [tok.decode(tok(t)["input_ids"]) for t in TEXTS],
        "chat": tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
    }


@pytest.mark.parametrize(
    ("tokenizer_class", "model_type"),
    [
        (None, "llama"),
        ("Qwen2Tokenizer", "qwen2"),
        ("LlamaTokenizerFast", "llama"),
        ("PreTrainedTokenizerFast", "qwen3"),
    ],
)
def test_a_remembered_class_builds_the_tokenizer_autotokenizer_builds(
    tiny_model: Path, tmp_path: Path, cache: Path, tokenizer_class: str | None, model_type: str
) -> None:
    model = str(variant(tiny_model, tmp_path / "m", tokenizer_class, model_type))
    expected = AutoTokenizer.from_pretrained(model, local_files_only=True)
    assert choice.remembered(model, VERSION) is None
    first = choice.load_tokenizer(model, local_files_only=True)  # a miss: AutoTokenizer's, recorded
    assert choice.remembered(model, VERSION) is type(expected)
    second = choice.load_tokenizer(model, local_files_only=True)  # a hit
    assert behaviour(first) == behaviour(second) == behaviour(expected)


def test_the_key_is_every_file_but_the_weights(tiny_model: Path, tmp_path: Path, cache: Path) -> None:
    model = variant(tiny_model, tmp_path / "m", None)
    (model / "model.safetensors").write_bytes(b"weights")
    key = choice.inputs_key(model)
    assert key is not None and choice.inputs_key(model) == key
    (model / "model.safetensors").write_bytes(b"other weights")  # not read
    assert choice.inputs_key(model) == key
    for name, change in [
        ("tokenizer_config.json", lambda t: t.replace("{", '{"model_max_length": 7, ', 1)),
        ("config.json", lambda t: t.replace("{", '{"tokenizer_class": "X", ', 1)),
        ("tekken.json", None),  # a file AutoTokenizer looks for, appearing
    ]:
        before = choice.inputs_key(model)
        f = model / name
        f.write_text("{}" if change is None else change(f.read_text()))
        assert choice.inputs_key(model) != before, name
    assert choice.inputs_key(tmp_path / "no-such-dir") is None


def test_another_version_or_changed_files_ask_autotokenizer_again(
    tiny_model: Path, tmp_path: Path, cache: Path
) -> None:
    model = variant(tiny_model, tmp_path / "m", "Qwen2Tokenizer", "qwen2")
    choice.load_tokenizer(str(model))
    assert choice.remembered(str(model), VERSION) is not None
    assert choice.remembered(str(model), "0.0.1") is None
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert choice.remembered(str(model), VERSION) is None
    # The new choice is recorded beside the old one.
    assert type(choice.load_tokenizer(str(model))) is type(AutoTokenizer.from_pretrained(str(model)))
    assert choice.remembered(str(model), VERSION) is not None


def test_a_models_own_code_and_a_path_named_like_a_hub_model_always_ask_autotokenizer(
    tiny_model: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = variant(tiny_model, tmp_path / "own", None)
    tc = json.loads((own / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTokenizer"]}
    (own / "tokenizer_config.json").write_text(json.dumps(tc))
    assert choice._has_own_code(str(own))
    asked: list[str] = []
    real = AutoTokenizer.from_pretrained

    def counting(path: str, **kwargs: Any) -> Any:
        asked.append(path)
        tc_plain = {k: v for k, v in tc.items() if k != "auto_map"}
        (own / "tokenizer_config.json").write_text(json.dumps(tc_plain))
        try:
            return real(path, **kwargs)
        finally:
            (own / "tokenizer_config.json").write_text(json.dumps(tc))

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    choice.load_tokenizer(str(own))
    choice.load_tokenizer(str(own))
    assert asked == [str(own), str(own)]
    assert not (cache / choice.CACHE_FILE).exists()
    # AutoTokenizer picks TokenizersBackend by name for these hub ids, whatever the files say.
    named = tmp_path / "deepseek-ai" / "deepseek-coder-1b"
    shutil.copytree(variant(tiny_model, tmp_path / "n", None), named)
    monkeypatch.undo()
    choice.remember(str(named), VERSION, transformers.PreTrainedTokenizerFast, ["*deepseek-coder-*"])
    assert not (cache / choice.CACHE_FILE).exists()
    plain = variant(tiny_model, tmp_path / "p", None)
    choice.remember(str(plain), VERSION, transformers.PreTrainedTokenizerFast, ["*deepseek-coder-*"])
    choice.remember(str(named), VERSION, transformers.PreTrainedTokenizerFast, [])
    assert choice.remembered(str(plain), VERSION) is not None
    # The patterns recorded with the version hold for every directory looked up under it.
    assert choice.remembered(str(named), VERSION) is not None
    choice.remember(str(plain), VERSION, transformers.PreTrainedTokenizerFast, ["*deepseek-coder-*"])
    assert choice.remembered(str(named), VERSION) is None


def test_only_transformers_own_classes_are_remembered(tiny_model: Path, tmp_path: Path, cache: Path) -> None:
    model = variant(tiny_model, tmp_path / "m", None)

    class Mine:
        pass

    choice.remember(str(model), VERSION, Mine, [])
    assert choice.remembered(str(model), VERSION) is None
    # A recorded entry naming something outside transformers, or nothing importable, is ignored.
    choice.remember(str(model), VERSION, transformers.PreTrainedTokenizerFast, [])
    data = json.loads((cache / choice.CACHE_FILE).read_text())
    (entry,) = data["transformers"][VERSION]["classes"].values()
    for module, name in [
        ("os", "path"),
        ("transformers.no_such_module", "X"),
        ("transformers", "NoSuchClass"),
    ]:
        entry.update(module=module, name=name)
        (cache / choice.CACHE_FILE).write_text(json.dumps(data))
        assert choice.remembered(str(model), VERSION) is None, module


def test_a_broken_unwritable_or_switched_off_cache_leaves_autotokenizer(
    tiny_model: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(variant(tiny_model, tmp_path / "m", None))
    expected = behaviour(AutoTokenizer.from_pretrained(model))
    cache.mkdir()
    (cache / choice.CACHE_FILE).write_text('{"format": 1, "transformers": {"')  # half a file
    assert behaviour(choice.load_tokenizer(model)) == expected
    assert choice.remembered(model, VERSION) is not None  # replaced by a whole one
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "sub"))
    assert behaviour(choice.load_tokenizer(model)) == expected
    monkeypatch.setenv(CACHE_ENV, "")
    assert cache_dir() is None
    assert behaviour(choice.load_tokenizer(model)) == expected
    assert choice.remembered(model, VERSION) is None


def test_the_cache_keeps_its_newest_entries(
    tiny_model: Path, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(choice, "MAX_ENTRIES", 2)
    models = [
        variant(tiny_model, tmp_path / str(i), None, model_type=t)
        for i, t in enumerate(["llama", "qwen2", "qwen3"])
    ]
    for m in models:
        choice.remember(str(m), VERSION, transformers.PreTrainedTokenizerFast, [])
    assert [choice.remembered(str(m), VERSION) is not None for m in models] == [False, True, True]
