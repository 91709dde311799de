"""The import hook: `slime.*` resolves to tether's slime API where the real slime is not importable.

`install()` puts one finder at the front of `sys.meta_path`, and only when
`importlib.util.find_spec("slime")` finds nothing: a machine with slime installed keeps it. The
finder also steps aside for `slime` whenever another finder can supply it (a `slime` folder put on
`sys.path` later wins), and serves submodules only while `sys.modules["slime"]` is ours.

What the finder serves, by name:

* the mirrored modules (`MIRRORED`): the very module objects under `tether.rollout.slime_api`
  (`slime.utils.types.Sample is tether.rollout.slime_api.utils.types.Sample`);
* `slime.ray` and everything below it: stand-ins whose every name raises `RayRequired` when used
  (importing them, and naming them in a signature, works);
* any other `slime.*` module: ModuleNotFoundError naming it and listing what is available.

The finder's registration in `sys.meta_path` is the only process-wide state of the slime API.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any, NoReturn

PACKAGE = "tether.rollout.slime_api"
MIRRORED: tuple[str, ...] = (
    "slime",
    "slime.utils",
    "slime.utils.types",
    "slime.utils.http_utils",
    "slime.utils.misc",
    "slime.utils.mask_utils",
    "slime.utils.async_utils",
    "slime.utils.processing_utils",
    "slime.rollout",
    "slime.rollout.base_types",
    "slime.rollout.sglang_rollout",
    "slime.rollout.sft_rollout",
    "slime.rollout.forge_load",
    "slime.rollout.data_source",
    "slime.rollout.rm_hub",
    "slime.rollout.rm_hub.math_utils",
    "slime.rollout.rm_hub.math_dapo_utils",
    "slime.rollout.rm_hub.deepscaler",
    "slime.rollout.rm_hub.f1",
    "slime.rollout.rm_hub.gpqa",
    "slime.rollout.rm_hub.ifbench",
    "slime.rollout.filter_hub",
    "slime.rollout.filter_hub.base_types",
    "slime.rollout.filter_hub.dynamic_sampling_filters",
    "slime.rollout.on_policy_distillation",
    "slime.backends",
    "slime.backends.megatron_utils",
    "slime.backends.megatron_utils.cp_utils",
    "slime.agent",
    "slime.agent.adapters",
    "slime.agent.adapters.common",
    "slime.agent.adapters.openai",
    "slime.agent.adapters.anthropic",
    "slime.agent.trajectory",
    "slime.agent.parsing",
    "slime.agent.sandbox",
    "slime.agent.aiohttp_threaded",
    "slime.agent.harness",
    "slime.agent.harness.common",
    "slime.agent.harness.claude_code",
    "slime.agent.harness.codex",
)
"""slime's modules that tether provides, each as the module of the same path under PACKAGE."""

RAY_HINT = (
    "rollout functions get tether's data source as their `data_source` argument (get_samples / "
    "add_samples), and hooks reach the engines at http://{args.sglang_router_ip}:{args.sglang_router_port}"
)


class RayRequired(RuntimeError):
    """A name of slime's API that only works with Ray's actors was used; tether has no Ray."""

    def __init__(self, name: str, needs: str = "Ray's rollout buffer actor", hint: str = RAY_HINT) -> None:
        self.name = name
        super().__init__(f"{name} needs {needs}; tether has no Ray: {hint}")


def target_of(name: str) -> str:
    """The tether module that serves slime module `name`."""
    return PACKAGE + name[len("slime") :]


class _RayOnly:
    """Stands for a name of `slime.ray.*`: it can be imported and named, and raises when used."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _refuse(self, what: str = "") -> NoReturn:
        raise RayRequired(object.__getattribute__(self, "_name") + what)

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("()")

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)  # copy, pickle and inspect probe these; answer as a plain object
        self._refuse(f".{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> NoReturn:
        self._refuse(" (as a base class)")

    def __repr__(self) -> str:
        return f"<{object.__getattribute__(self, '_name')}: needs Ray, which tether does not have>"


class _RayModule(types.ModuleType):
    """`slime.ray` or a module below it: every name is a `_RayOnly` stand-in."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _RayOnly(f"{self.__name__}.{attr}")


class _RayLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _RayModule(spec.name)
        module.__path__ = []  # a package: `slime.ray.buffer` and the like import too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _AliasLoader(importlib.abc.Loader):
    """Loads `slime.X` as the already-importable module `tether.rollout.slime_api.X` itself."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system set `__spec__` to the alias's; the module keeps its own identity.
        module.__spec__ = self._own_spec


class SlimeFinder(importlib.abc.MetaPathFinder):
    """Serves `slime.*` from tether's slime API; see the module docstring."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "slime" and not fullname.startswith("slime."):
            return None
        if fullname == "slime":
            if self._another_slime():
                return None
        elif getattr(sys.modules.get("slime"), "__name__", None) != PACKAGE:
            return None  # a real slime is imported: its submodules are its own
        if fullname == "slime.ray" or fullname.startswith("slime.ray."):
            return importlib.machinery.ModuleSpec(fullname, _RayLoader(), is_package=True)
        if fullname not in MIRRORED:
            available = ", ".join(MIRRORED[1:])
            raise ModuleNotFoundError(
                f"{fullname} is not part of tether's slime API (slime is not installed here); "
                f"available: {available}; slime.ray.* exists but needs Ray",
                name=fullname,
            )
        target_name = target_of(fullname)
        is_package = hasattr(importlib.import_module(target_name), "__path__")
        return importlib.util.spec_from_loader(fullname, _AliasLoader(target_name), is_package=is_package)

    def _another_slime(self) -> bool:
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, SlimeFinder):
                continue
            find = getattr(finder, "find_spec", None)
            if find is not None and find("slime", None) is not None:
                return True
        return False


_lock = threading.Lock()  # hooks load in threads; one finder, installed once


def installed() -> bool:
    return any(isinstance(f, SlimeFinder) for f in sys.meta_path)


def install() -> bool:
    """Serve `slime.*` from tether's slime API unless a real slime is importable.

    Returns True when tether's API answers `import slime` (now or from an earlier call), False
    when the real slime is there and left alone.
    """
    with _lock:
        if installed():
            return getattr(sys.modules.get("slime"), "__name__", PACKAGE) == PACKAGE
        if importlib.util.find_spec("slime") is not None:
            return False
        sys.meta_path.insert(0, SlimeFinder())
        return True


def uninstall() -> None:
    """Remove the finder and forget every `slime.*` module it served (tests use this)."""
    with _lock:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, SlimeFinder)]
        for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
            module = sys.modules[name]
            if isinstance(module, _RayModule) or getattr(module, "__name__", "").startswith(PACKAGE):
                del sys.modules[name]
