"""mbridge's bridges imported one family at a time.

Importing any module of mbridge runs its package `__init__`, which imports every bridge it ships,
the vision-language ones with transformers' modelling code among them: ~0.44 s of CPU in the
rank zygote's preload (measured after torch, megatron-core and transformers were imported), for
the one family a run trains, and on the path to every rank's first step.

`defer_mbridge()` puts the packages `mbridge` and `mbridge.models` into `sys.modules` unexecuted
(their specs' modules, `__path__` included), so `import mbridge.models.llama` runs that module
alone. A bridge class asked of `mbridge.models` (`from ..models import Qwen2Bridge`, as some
bridges import their bases) imports the module that defines it; any other attribute of either
package runs the real `__init__`s (`mbridge.AutoBridge`, `from mbridge.models import *`), so code
that wants the whole package still gets all of it. Which module registers a model type is read from mbridge's own
sources (`@register_model("...")`), not listed here: a newer mbridge brings its families along.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path

from tether.runtime.process import deferred_package

_REGISTERS = re.compile(r"""@register_model\(\s*["']([^"']+)["']\s*\)""")
_CLASSES = re.compile(r"^class (\w+)\b", re.MULTILINE)
_PACKAGES = ("mbridge", "mbridge.models")  # parent first: finding the child's spec needs the parent


def defer_mbridge() -> bool:
    """Put mbridge's two packages in `sys.modules` unexecuted; False (nothing done) when mbridge
    is already imported or not installed."""
    return deferred_package.defer(_PACKAGES, _bridge_class_module)


def _bridge_class_module(module: types.ModuleType, name: str) -> object:
    # A bridge class asked of `mbridge.models` (some bridges import their base classes so,
    # mid-import, which must not run the package's own __init__): its module alone.
    if module.__name__ == _PACKAGES[1]:
        defined_in = _scan(_CLASSES).get(name)
        if defined_in is not None:
            return getattr(importlib.import_module(defined_in), name)
    return deferred_package.MISSING


def complete_mbridge() -> None:
    """Run the `__init__` of each deferred package (models first: mbridge's own imports it and
    its registry must be whole before anyone reads it)."""
    deferred_package.complete(_PACKAGES)


def family_modules() -> Mapping[str, str]:
    """model_type → the mbridge module whose `@register_model` registers it, read from the
    sources of `mbridge.models` (defers mbridge first, so nothing is imported)."""
    defer_mbridge()
    return _scan(_REGISTERS)


@functools.cache  # the installed sources do not change within a process: read them once per pattern
def _scan(pattern: re.Pattern[str]) -> Mapping[str, str]:
    """What `pattern` finds in the sources of `mbridge.models` → the module it is in (first wins)."""
    spec = importlib.util.find_spec(_PACKAGES[1])
    if spec is None or not spec.submodule_search_locations:
        return types.MappingProxyType({})
    out: dict[str, str] = {}
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            module = ".".join((_PACKAGES[1], *parts))
            for found in pattern.findall(path.read_text(errors="replace")):
                out.setdefault(found, module)
    return types.MappingProxyType(out)


def register_families(model_types: Iterable[str]) -> None:
    """Import the mbridge modules that register `model_types`. A type no source registers may
    still be registered at run time by some module: then all of mbridge is imported, as before."""
    modules = family_modules()
    wanted = list(model_types)
    if not modules or any(t not in modules for t in wanted):
        import_all()
        return
    for model_type in wanted:
        importlib.import_module(modules[model_type])


def import_all() -> None:
    """All of mbridge, as its own `import mbridge` gives it (deferred packages completed)."""
    complete_mbridge()
    importlib.import_module(_PACKAGES[0])
    importlib.import_module(_PACKAGES[1])
