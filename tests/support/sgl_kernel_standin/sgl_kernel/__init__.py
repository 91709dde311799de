"""A pure-torch stand-in for the CPU build of `sgl_kernel`, which PyPI does not ship.

SGLang 0.5.x on CPU (SGLANG_USE_CPU_ENGINE=1) imports two kernels from `sgl_kernel` at module
load: `assign_req_to_token_pool_cpu` (called on every prefill, implemented here) and
`copy_all_layer_kv_cache_cpu` (only used by speculative decoding's KV moves). Every other name
resolves to a function that raises, naming itself, so a code path we have not covered fails
loudly instead of computing garbage. tests/support/sglang_env.sh installs this package into the engine
venv; it is never imported by tether itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

__version__ = "0.0.0+tether.standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request → token table.

    Request i owns row `req_pool_indices[i]`; its slots `[start_offset[i], end_offset[i])` take
    the next `end - start` entries of `out_cache_loc`, which holds all requests' slots back to back.
    """
    counts = (end_offset - start_offset).tolist()
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    cursor = 0
    for row, start, count in zip(rows, starts, counts, strict=True):
        if count <= 0:
            continue
        if start + count > pool_len:
            raise IndexError(f"request row {row}: slots {start}..{start + count} exceed the pool length {pool_len}")
        req_to_token[row, start : start + count] = out_cache_loc[cursor : cursor + count].to(req_to_token.dtype)
        cursor += count


def _unavailable(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel stand-in (tether tests): kernel {name!r} has no CPU implementation")

    kernel.__name__ = name
    return kernel


def __getattr__(name: str) -> Any:
    # Dunder lookups (pickling, introspection) must fail normally rather than return a kernel.
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(name)
