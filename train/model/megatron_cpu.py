"""Make megatron-core 0.16 run on a CPU-only torch build (gloo, fp32).

megatron-core assumes CUDA in a handful of places; on a machine without a GPU each of those
calls fails. `apply()` redirects exactly those calls to the CPU and does nothing when CUDA is
available, so GPU runs execute Megatron unmodified. Each patch below says which Megatron call
path needs it (each measured on megatron-core 0.16.1):

1. `torch.cuda.current_device()` is passed as `device=` when tensor_parallel/ layers, the
   vocab-parallel cross entropy and utils allocate buffers: it returns "cpu".
2. The model-parallel RNG tracker (`model_parallel_cuda_manual_seed`, `CudaRNGStatesTracker`,
   `get_cuda_rng_tracker().fork()`) seeds and swaps the CUDA generator: it uses the CPU one.
3. Factory functions called with `device="cuda"`, an integer device or `pin_memory=True`
   (causal mask in transformer/utils.py, schedules.py, param_and_grad_buffer.py, optimizer,
   clip_grads.py, distrib_optimizer.py, dist_checkpointing) allocate on the CPU instead, and
   `Tensor.cuda()` / `Tensor.to("cuda")` are no-ops.
4. `Tensor.type()` is compared against "torch.cuda.FloatTensor" in the optimizer and
   clip_grads.py to pick fp32 parameters: a CPU tensor reports the cuda name.
5. `torch.cuda.synchronize`, `torch.cuda.empty_cache` and stream/event helpers that Megatron
   calls around steps and checkpoint saves become no-ops.

Only the factory functions are wrapped (not a global TorchFunctionMode), which measured about
2x cheaper per step. Patches are marked so `apply()` is idempotent.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MARK = "_tether_cpu_patch"

# Factory functions that Megatron calls with device="cuda" or pin_memory=True.
_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "eye",
    "as_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "empty_strided",
)

# Megatron warns at import time that TransformerEngine/Apex are missing; on CPU that is expected.
_IMPORT_WARNINGS = (
    r"(Transformer Engine and Apex are not installed|Apex is not installed|.*TransformerEngine.*)"
)


def needed() -> bool:
    """True when this process has no usable CUDA device, so Megatron needs the patches."""
    return not torch.cuda.is_available()


def _is_cuda(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # Megatron passes torch.cuda.current_device() (an int) as a device.
    return isinstance(device, int) and not isinstance(device, bool)


def _marked(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


def _wrap_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return _marked(wrapper)


def _patch_torch() -> None:
    cuda: Any = torch.cuda
    cuda.current_device = _marked(lambda: "cpu")
    # Seed only the CPU generator: torch.manual_seed itself calls cuda.manual_seed_all.
    cuda.manual_seed = _marked(lambda seed: torch.default_generator.manual_seed(int(seed)))
    cuda.get_rng_state = _marked(lambda device="cuda": torch.get_rng_state())
    cuda.set_rng_state = _marked(lambda new_state, device="cuda": torch.set_rng_state(new_state))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.synchronize = _marked(lambda *a, **k: None)
    cuda.empty_cache = _marked(lambda *a, **k: None)
    # `with torch.device(...)` recognises factory functions by identity in a cached set; fill
    # the cache with the originals first, or device contexts (transformers' loader) miss them.
    import torch.utils._device as torch_device

    torch_device._device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))

    orig_type = torch.Tensor.type
    orig_to = torch.Tensor.to

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = orig_type(self, *args, **kwargs)
        if not args and not kwargs and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch.") :]
        return name

    def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args and _is_cuda(args[0]):
            args = ("cpu", *args[1:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return orig_to(self, *args, **kwargs)

    tensor: Any = torch.Tensor
    tensor.type = _marked(tensor_type)
    tensor.to = _marked(tensor_to)
    tensor.cuda = _marked(lambda self, *a, **k: self)
    tensor.pin_memory = _marked(lambda self, *a, **k: self)


def _patch_megatron_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    def get_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom_any: Any = mrandom
    mrandom_any._get_cuda_rng_state = _marked(get_state)
    mrandom_any._set_cuda_rng_state = _marked(set_state)


def apply() -> bool:
    """Patch torch/Megatron for CPU if CUDA is absent; returns whether patches are active.

    Call after `torch.distributed.init_process_group` and before building any Megatron model.
    """
    if not needed():
        return False
    if not getattr(torch.cuda.current_device, _MARK, False):
        _patch_torch()
    with quiet_megatron_imports():
        import megatron.core.tensor_parallel.random as mrandom
    if not getattr(mrandom._get_cuda_rng_state, _MARK, False):
        _patch_megatron_rng()
    return True


@contextlib.contextmanager
def quiet_megatron_imports() -> Iterator[None]:
    """Silence the import-time warnings about absent TransformerEngine/Apex (expected on CPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_IMPORT_WARNINGS, category=UserWarning)
        yield


# Imported by Megatron's own modules (timers' log writers, the inference engine's context) and never
# used by a tether rank, which logs from the head: ~0.8 s of every rank's start-up.
_UNUSED_AT_IMPORT = ("wandb", "torch.utils.tensorboard")


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile` that imports TorchDynamo/Inductor at a compiled function's first call.

    `torch.compile(fn)` already compiles lazily, at the first call; only its imports of Dynamo and
    Inductor (~1.5 s) happen at once. Megatron decorates its fusion kernels with it while being
    imported (megatron.core.jit.jit_fuser), and tether's CPU ranks call none of them (the fusions
    are off, tether.train.model.bridge). Same result at the call, with the same options.
    """

    def compile_later(model: Callable[..., Any] | None = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return _marked(call)

    return compile_later


@contextlib.contextmanager
def lean_megatron_imports() -> Iterator[None]:
    """Import Megatron's modules without what their import pulls in that a rank does not use:
    `torch.compile` defers Dynamo/Inductor to a first call (`deferred_compile`), and wandb and
    TensorBoard look absent to the modules imported here (Megatron then keeps None for them, as
    when they are not installed). Both last only as long as the block: a user's later
    `import wandb` or `torch.compile` is the real one. Quiet as `quiet_megatron_imports`.
    """
    hidden = [name for name in _UNUSED_AT_IMPORT if name not in sys.modules]
    real_compile = torch.compile
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    torch.compile = deferred_compile(real_compile)  # type: ignore[assignment]
    try:
        with quiet_megatron_imports():
            yield
    finally:
        torch.compile = real_compile  # type: ignore[assignment]
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
