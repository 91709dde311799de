"""Packages put into `sys.modules` unexecuted, their `__init__` run only when something needs it.

Some packages' `__init__` does far more than their submodules need: mbridge's imports every
bridge it ships (`tether.train.model.mbridge_import`), and `transformers.models`' reads the
source of each of its ~400 model directories to build its lazy name table (0.35 s of CPU in
every process that loads a tokenizer or a model config, which import their own model's
modules directly). `defer` puts such a package in `sys.modules` as its spec's module, unexecuted
but with its `__path__`, so importing a submodule runs that submodule alone. Any attribute the
package lacks (PEP 562's `__getattr__`) first asks the caller's `find` (mbridge finds a bridge
class's module this way), else runs the real `__init__` (`complete`) and answers from it: code
that wants the whole package still gets all of it. `TETHER_DEFER_IMPORTS=0` defers nothing
(every package's `__init__` runs at its first import, as Python does by itself).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable, Sequence

# The attribute a deferred package carries until `complete` runs its `__init__`.
DEFERRED = "__tether_deferred__"
TRANSFORMERS_MODELS = "transformers.models"

Find = Callable[[types.ModuleType, str], object]
"""(deferred package, attribute) → the attribute, found without running the package's
`__init__`, or `MISSING` where it cannot."""
MISSING = object()
SWITCH_ENV = "TETHER_DEFER_IMPORTS"


def defer(names: Sequence[str], find: Find | None = None) -> bool:
    """Put the packages `names` (a parent before its child) in `sys.modules` unexecuted; False,
    with nothing done, where the first is imported already or not installed. A parent package
    not in `names` is imported for real (finding the child's spec needs it)."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return False
    if names[0] in sys.modules or importlib.util.find_spec(names[0]) is None:
        return False
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not a package: it cannot be deferred")
        module = importlib.util.module_from_spec(spec)
        module.__dict__[DEFERRED] = tuple(names)
        module.__dict__["__getattr__"] = _completer(module, find)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True


def is_deferred(name: str) -> bool:
    """Whether package `name` is in `sys.modules` deferred (its `__init__` not run yet)."""
    module = sys.modules.get(name)
    return module is not None and DEFERRED in module.__dict__


def complete(names: Sequence[str]) -> None:
    """Run the `__init__` of each deferred package of `names`, children first (a parent's
    `__init__` may import its child and read what the child's made). A package whose `__init__`
    replaces its `sys.modules` entry (transformers' `_LazyModule`) is answered from the
    replacement through the deferred module too, and its parent's attribute points at it."""
    for name in reversed(names):
        module = sys.modules.get(name)
        if module is None or DEFERRED not in module.__dict__:
            continue
        del module.__dict__[DEFERRED]  # runs once; the real namespace fills in below
        del module.__dict__["__getattr__"]
        spec = module.__spec__
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(module)
        real = sys.modules.get(name, module)
        if real is not module:
            module.__dict__["__getattr__"] = lambda attr, real=real: getattr(real, attr)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, real)


def _completer(module: types.ModuleType, find: Find | None) -> Callable[[str], object]:
    def __getattr__(attr: str) -> object:
        if find is not None and DEFERRED in module.__dict__:
            found = find(module, attr)
            if found is not MISSING:
                return found
        names = module.__dict__.get(DEFERRED)
        if names is not None:
            complete(names)
        return getattr(sys.modules.get(module.__name__, module), attr)

    return __getattr__


def defer_transformers_models() -> bool:
    """Defer `transformers.models` (see the module docstring); transformers itself is imported
    here if it is not yet, its models' name table remembered between runs
    (`tether.runtime.process.transformers_table`). False where `transformers.models` is imported already or transformers
    is not installed. Loading a tokenizer or a config imports only that model's modules."""
    if importlib.util.find_spec("transformers") is None:  # else finding the child's spec raises
        return False
    from tether.runtime.process.transformers_table import remember_transformers_table

    remember_transformers_table()  # transformers' own name table: read, not rebuilt, if remembered
    return defer((TRANSFORMERS_MODELS,))
