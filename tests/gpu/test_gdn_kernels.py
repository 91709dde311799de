"""The gated delta rule kernels --qwen-gdn-backend picks for Qwen3-Next/Qwen3.5's linear attention,
on a GPU: flash-linear-attention's (fla) and FlashQLA's (flashqla) against Megatron's pure-torch
rule (what CPU ranks run), on the same inputs. Skipped without CUDA or without the kernel's module."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, h, dk, dv = 2, 96, 4, 64, 64

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    q = torch.nn.functional.normalize(rand(b, t, h, dk), dim=-1)
    k = torch.nn.functional.normalize(rand(b, t, h, dk), dim=-1)
    return {
        "query": q.to(torch.bfloat16),
        "key": k.to(torch.bfloat16),
        "value": rand(b, t, h, dv).to(torch.bfloat16),
        "g": -torch.rand(b, t, h, generator=g, device="cuda"),
        "beta": torch.rand(b, t, h, generator=g, device="cuda").to(torch.bfloat16),
    }


def _run(rule: Any, inputs: dict[str, Any]) -> torch.Tensor:
    q, k, v = inputs["query"], inputs["key"], inputs["value"]
    out, _ = rule(
        q, k, v, g=inputs["g"], beta=inputs["beta"], initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False,
    )  # fmt: skip
    return out.float()


@needs_cuda
@pytest.mark.parametrize("backend", ["fla", "flashqla"])
def test_gdn_backend_matches_the_torch_rule(backend: str) -> None:
    module = {"fla": "fla", "flashqla": "flash_qla"}[backend]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    from megatron.core.ssm import gated_delta_net

    from tether.train.model.families.qwen3_next import select_gdn_backend

    reference = gated_delta_net.torch_chunk_gated_delta_rule
    select_gdn_backend(backend)
    inputs = _inputs()
    got = _run(gated_delta_net.chunk_gated_delta_rule, inputs)
    want = _run(reference, {k: v.float() for k, v in inputs.items()})
    assert torch.allclose(got, want, atol=5e-2, rtol=5e-2), float((got - want).abs().max())
