"""What the machine a trainer rank runs on can do, and the Megatron flags that need more.

Some Megatron flags need CUDA or TransformerEngine (TE) kernels. `check_capabilities` refuses them,
naming the flag, the value and the missing capability, at two points with one function:

- at parse time (`tether plan` and `tether run`, through the config's cross-slice checks) for a run
  planned on CPU devices (`--cpu-devices`): `Capabilities.cpu()`;
- on each trainer rank before the model is built, with what the rank detects
  (`Capabilities.detect()`), for a GPU plan whose ranks lack TE.

Fusion flags (`--no-*-fusion`) are never refused: a fusion whose kernel is missing is off anyway, so
asking for it to be off holds. This module imports no torch at import time (the head parses flags
without it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from tether.runtime.errors import ConfigError
from tether.train.config import MegatronConfig

TE_ATTENTION_BACKENDS = ("flash", "fused", "unfused")


@dataclass(frozen=True)
class Capabilities:
    """Kernels and devices a trainer rank can use."""

    cuda: bool
    """A CUDA device is available to this rank."""
    transformer_engine: bool
    """TransformerEngine imports (its layer spec, attention backends, fused RoPE, FusedAdam)."""
    fused_softmax_kernels: bool
    """Megatron's fused masked-softmax CUDA extension (`scaled_masked_softmax_cuda`) imports."""
    fused_wgrad_kernels: bool
    """Apex's fused weight-gradient accumulation extension (`fused_weight_gradient_mlp_cuda`) imports."""
    deep_ep: bool = False
    """DeepEP's expert-parallel communication library (`deep_ep`) imports (--moe-enable-deepep)."""
    flash_qla: bool = False
    """FlashQLA's gated-delta-rule kernels (`flash_qla`) import (--qwen-gdn-backend flashqla)."""

    @classmethod
    def cpu(cls) -> Capabilities:
        """A CPU-only rank (a plan on --cpu-devices)."""
        return cls(
            cuda=False, transformer_engine=False, fused_softmax_kernels=False, fused_wgrad_kernels=False
        )

    @classmethod
    def full_gpu(cls) -> Capabilities:
        """A GPU rank with every optional kernel installed."""
        return cls(
            cuda=True,
            transformer_engine=True,
            fused_softmax_kernels=True,
            fused_wgrad_kernels=True,
            deep_ep=True,
            flash_qla=True,
        )

    @classmethod
    def detect(cls) -> Capabilities:
        """This process's capabilities (imports torch)."""
        import torch

        cuda = torch.cuda.is_available()

        def importable(name: str) -> bool:
            return cuda and importlib.util.find_spec(name) is not None

        return cls(
            cuda=cuda,
            transformer_engine=importable("transformer_engine"),
            fused_softmax_kernels=importable("scaled_masked_softmax_cuda"),
            fused_wgrad_kernels=importable("fused_weight_gradient_mlp_cuda"),
            deep_ep=importable("deep_ep"),
            flash_qla=importable("flash_qla"),
        )

    def missing(self, *, cuda: bool = False, transformer_engine: bool = False) -> str | None:
        """Words for what is missing of the asked capabilities, or None when all are there."""
        if cuda and not self.cuda:
            return "needs CUDA, and this trainer runs on CPU"
        if transformer_engine and not self.transformer_engine:
            where = "this trainer runs on CPU" if not self.cuda else "transformer_engine is not installed"
            return f"needs CUDA and TransformerEngine, and {where}"
        return None


def uses_transformer_engine_spec(megatron: MegatronConfig, caps: Capabilities) -> bool:
    """Whether the model is built with TransformerEngine's layers (else Megatron's local ones)."""
    return caps.transformer_engine and megatron.resolved_attention_backend != "local"


def check_capabilities(megatron: MegatronConfig, caps: Capabilities, *, where: str = "") -> None:
    """Refuse the flags `caps` cannot run, naming flag, value and the missing capability.

    `where` is appended to the reason (e.g. how the run was planned on CPU).
    """

    def refuse(flag: str, value: object, missing: str, why: str) -> None:
        raise ConfigError(flag, value, f"{missing} ({why}){where}")

    te = caps.missing(transformer_engine=True)
    cuda = caps.missing(cuda=True)
    # --sequence-parallel runs without TE too: the local spec's norms accept it (train/model/spec.py).
    if megatron.moe_grouped_gemm and te:
        refuse("--moe-grouped-gemm", True, te, "the experts' grouped GEMM is TE's GroupedLinear")
    if megatron.moe_permute_fusion and te:
        refuse("--moe-permute-fusion", True, te, "the fused permutation is a TE kernel")
    if megatron.moe_enable_deepep and (cuda or not caps.deep_ep):
        missing = cuda or "needs the deep_ep module (DeepEP), which is not installed"
        refuse("--moe-enable-deepep", True, missing, "DeepEP's dispatch kernels run on GPUs")
    if megatron.qwen_gdn_backend == "flashqla" and (cuda or not caps.flash_qla):
        missing = cuda or "needs the flash_qla module (FlashQLA), which is not installed"
        refuse("--qwen-gdn-backend", "flashqla", missing, "FlashQLA's gated delta rule runs on GPUs")
    if megatron.moe_token_dispatcher_type == "flex" and cuda:
        refuse(
            "--moe-token-dispatcher-type",
            "flex",
            cuda,
            "the flex dispatcher runs DeepEP/HybridEP kernels on GPUs",
        )
    backend = megatron.resolved_attention_backend
    if backend in TE_ATTENTION_BACKENDS and te:
        flag = "--use-flash-attn" if megatron.use_flash_attn else "--attention-backend"
        refuse(flag, True if megatron.use_flash_attn else backend, te, f"{backend} attention is a TE kernel")
    if megatron.optimizer_cpu_offload and cuda:
        refuse(
            "--optimizer-cpu-offload",
            True,
            cuda,
            "Megatron's hybrid device optimizer moves state between a GPU and host RAM on CUDA streams",
        )
    if megatron.use_precision_aware_optimizer and te:
        refuse("--use-precision-aware-optimizer", True, te, "it is TE's FusedAdam")
