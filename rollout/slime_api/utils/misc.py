"""`slime.utils.misc`: the helpers hooks use (`load_function`, `SingletonMeta`, `group_by`, ...)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

from tether.rollout.hooks.calls import load_function as _load
from tether.rollout.slime_api.finder import RayRequired
from tether.rollout.slime_api.utils.http_utils import is_port_available

T = TypeVar("T")


def load_function(path: str) -> Callable[..., Any]:
    """The function at `package.module.function` (tether also takes `file.py:function`).

    A path that cannot be imported raises ConfigError naming it and the reason.
    """
    return _load(path, "load_function")


class SingletonMeta(type):
    """A metaclass whose classes have one instance: the first one made (kept on the class itself)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = cls.__dict__.get("_singleton_instance")
        if instance is None:
            instance = super().__call__(*args, **kwargs)
            type.__setattr__(cls, "_singleton_instance", instance)
        return instance

    def clear_instances(cls) -> None:
        if "_singleton_instance" in cls.__dict__:
            type.__delattr__(cls, "_singleton_instance")


def group_by(iterable: Iterable[T], key: Callable[[T], Hashable] | None = None) -> dict[Any, list[T]]:
    """Items by `key(item)` (or the item itself), in first-seen order; the input need not be sorted."""
    out: dict[Any, list[T]] = defaultdict(list)
    for item in iterable:
        out[key(item) if key is not None else item].append(item)
    return dict(out)


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
