"""`slime.utils.misc`: the helpers hooks use (`load_function`, `SingletonMeta`, `group_by`, ...).

Names, signatures and behaviour are slime's; only `get_current_node_ip` (Ray's node table) refuses.
tether's own callers of slime's API load hooks through `_load_for_flag`, which calls this module's
`load_function(path)` when it runs, so a patched `slime.utils.misc.load_function` is the one used.
"""

from __future__ import annotations

import base64
import functools
import subprocess
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from tether.rollout.hooks.loader import load_function as _load
from tether.rollout.slime_api.finder import RayRequired
from tether.rollout.slime_api.utils.http_utils import is_port_available
from tether.runtime.errors import ConfigError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
_OWN_KEY = "load_function"  # the ConfigError key of a failure inside load_function itself


@functools.cache
def load_function(path: str) -> Callable[..., Any]:
    """The function at `package.module.function` (tether also takes `file.py:function`).

    Cached per path, as slime's (`functools.cache`): a hook that is loaded again is not re-imported.
    A path that cannot be imported raises ConfigError naming it and the reason.
    """
    return _load(path, _OWN_KEY)


def _load_for_flag(path: str, flag: str) -> Callable[..., Any]:
    """`load_function(path)` for tether's callers, its import errors naming the flag that gave `path`.

    `load_function` is looked up at call time: hooks and tests that replace
    `slime.utils.misc.load_function` (a one-argument function, as slime's) reach every caller."""
    try:
        return load_function(path)
    except ConfigError as exc:
        if exc.key != _OWN_KEY:
            raise
        raise ConfigError(flag, exc.value, exc.reason) from exc


class SingletonMeta(type):
    """A metaclass whose classes each have one instance: the first call makes it, later calls return it.

    As in slime, instances are kept in `_instances`, keyed by class: one dict on the metaclass, shared
    by its classes, until `Cls.clear_instances()` gives `Cls` (and so its subclasses) an empty one.
    """

    _instances: dict[type, Any] = {}  # noqa: RUF012 - per-class state lives here, as in slime

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}


def decode_int32_meta_array(meta_info: dict[str, Any], keys: str | Iterable[str]) -> torch.Tensor | None:
    """The int32 array under the first of `keys` present in an engine's `meta_info`, flat, on the CPU.

    It may come as base64 text, raw bytes, a tensor, or anything `torch.as_tensor` takes (a list,
    a numpy array); None when no key is present or its value is None.
    """
    import torch

    for key in (keys,) if isinstance(keys, str) else keys:
        if key in meta_info:
            value = meta_info[key]
            break
    else:
        return None
    if value is None:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, bytes | bytearray | memoryview):
        return torch.frombuffer(bytearray(value), dtype=torch.int32)
    if torch.is_tensor(value):
        return value.detach().to(device="cpu", dtype=torch.int32).reshape(-1)
    if hasattr(value, "flags") and not value.flags.writeable:
        value = value.copy()  # torch warns on (and may not share) a read-only numpy buffer
    return torch.as_tensor(value, dtype=torch.int32).reshape(-1)


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """Run `cmd` with bash, echoing it first; raises CalledProcessError when it fails.

    With `capture_output`, returns its stdout (and prints what it captured); else None.
    """
    print(f"EXEC: {cmd}", flush=True)
    try:
        done = subprocess.run(
            ["bash", "-c", cmd], check=True, capture_output=capture_output, text=capture_output
        )
    except subprocess.CalledProcessError as exc:
        if capture_output:
            print(f"exec_command failed: stdout={exc.stdout!r} stderr={exc.stderr!r}")
        raise
    if not capture_output:
        return None
    print(f"exec_command captured stdout={done.stdout!r} stderr={done.stderr!r}")
    return str(done.stdout)


def group_by(iterable: Iterable[T], key: Callable[[T], Hashable] | None = None) -> dict[Any, list[T]]:
    """Items by `key(item)` (or the item itself), in first-seen order; the input need not be sorted."""
    out: dict[Any, list[T]] = defaultdict(list)
    for item in iterable:
        out[key(item) if key is not None else item].append(item)
    return dict(out)


def chunk_named_params_by_size(
    named_params: Iterable[tuple[str, Any]], chunk_size: int
) -> Iterator[list[tuple[str, Any]]]:
    """`(name, tensor)` pairs in order, grouped so that a group closes before it would reach
    `chunk_size` bytes (a single larger tensor makes a group of its own)."""
    return _buckets_by_size(named_params, lambda named: int(named[1].nbytes), chunk_size)


def _buckets_by_size(items: Iterable[T], size_of: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    bucket: list[T] = []
    filled = 0
    for item in items:
        size = size_of(item)
        if bucket and filled + size >= limit:
            yield bucket
            bucket, filled = [], 0
        bucket.append(item)
        filled += size
    if bucket:
        yield bucket


def should_run_periodic_action(
    rollout_id: int,
    interval: int | None,
    num_rollout_per_epoch: int | None = None,
    num_rollout: int | None = None,
) -> bool:
    """Whether a periodic action (eval, save) is due after rollout `rollout_id` (0-based)."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    done = rollout_id + 1
    return done % interval == 0 or (num_rollout_per_epoch is not None and done % num_rollout_per_epoch == 0)


def get_free_port(start_port: int = 10000, consecutive: int = 1) -> int:
    """The first port from `start_port` up with `consecutive` bindable ports in a row."""
    port = start_port
    while not all(is_port_available(port + i) for i in range(consecutive)):
        port += 1
    return port


class Box:
    """Holds a value (slime wraps Ray object refs in it)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    @property
    def inner(self) -> Any:
        return self._inner


def get_current_node_ip() -> str:
    raise RayRequired("slime.utils.misc.get_current_node_ip()", "Ray's node table")
