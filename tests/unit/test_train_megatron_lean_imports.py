"""A rank imports Megatron without Dynamo/Inductor, wandb and TensorBoard (train/model/megatron_cpu.py):
`torch.compile` compiles at a function's first call with the same options, and the hidden modules
are hidden only inside the block."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
import torch

from tether.train.model.megatron_cpu import deferred_compile, lean_megatron_imports


def test_deferred_compile_compiles_once_at_the_first_call_with_the_same_options() -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []

    def fake_compile(fn: Any, **options: Any) -> Any:
        calls.append((fn, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = deferred_compile(fake_compile)

    def add(a: int, b: int = 0) -> int:
        """Adds."""
        return a + b

    lazy = compile_later(add, dynamic=False)
    decorated = compile_later(fullgraph=True)(add)  # the @torch.compile(...) form
    assert calls == []  # nothing compiled (nor imported) yet
    assert lazy.__name__ == "add" and lazy.__doc__ == "Adds."
    assert lazy(1, b=2) == ("compiled", 3) and lazy(2) == ("compiled", 2)
    assert decorated(5) == ("compiled", 5)
    assert calls == [(add, {"dynamic": False}), (add, {"fullgraph": True})]  # once per function


def test_lean_imports_hide_wandb_and_tensorboard_only_inside_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("wandb", "torch.utils.tensorboard"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    real = torch.compile
    with lean_megatron_imports():
        for name in ("wandb", "torch.utils.tensorboard"):
            with pytest.raises(ImportError):
                importlib.import_module(name)
        assert torch.compile is not real and getattr(torch.compile(len), "__wrapped__", None) is len
    assert torch.compile is real
    assert "wandb" not in sys.modules and "torch.utils.tensorboard" not in sys.modules


def test_lean_imports_leave_an_imported_module_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    already = type(sys)("wandb")
    monkeypatch.setitem(sys.modules, "wandb", already)
    with lean_megatron_imports():
        assert importlib.import_module("wandb") is already
    assert sys.modules["wandb"] is already


def test_lean_imports_restore_on_error() -> None:
    real = torch.compile
    with pytest.raises(RuntimeError, match="boom"), lean_megatron_imports():
        raise RuntimeError("boom")
    assert torch.compile is real and sys.modules.get("wandb", 0) is not None
