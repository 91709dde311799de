"""SGLang's `/weights_checker` for the CPU engine: the request and answer SGLang 0.5 serves
(sglang/srt/entrypoints/http_server.py, utils/weight_checker.py), which slime's
--check-weight-update-equal drives as snapshot → reset_tensors → (a weight update) → compare.

    POST /weights_checker {"action": "snapshot" | "reset_tensors" | "compare" | "checksum",
                           "allow_quant_error": false, "skip_tensor_list": [substrings] | null,
                           "selector": "target" | "draft" | "all"}
    → 200 {"success": true, "message": "Success."}
      (checksum adds "ranks": [{checksums, per_gpu_checksum, parallelism_info}], "per_engine_checksum")
    → 400 {"success": false, "message": "check tensor equality failed:\\nname=... max_abs_err=..."}

`snapshot` copies every weight; `reset_tensors` overwrites each weight not skipped with uniform
noise in [0, 1); `compare` checks every weight not skipped against the snapshot bit for bit and
names each one that differs (then drops the snapshot, as SGLang does on success). The engine holds
no quantized weights, so `allow_quant_error` changes nothing. `checksum` hashes each weight with
SHA-256 (SGLang uses its own tensor hash, so the digests differ from SGLang's, the shape does not).
This engine has no draft model: `selector: "draft"` acts on nothing.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec
import torch


class CheckWeightsReq(msgspec.Struct, kw_only=True):
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None  # substrings of weight names to leave out
    selector: Literal["target", "draft", "all"] = "all"


class WeightsCheckFailed(Exception):
    """The check failed; the message is what SGLang answers in "message"."""


def _skipped(name: str, skip: list[str] | None) -> bool:
    return any(pattern in name for pattern in skip or ())


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def _overall(checksums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


class WeightsChecker:
    """One engine's snapshot between `snapshot` and `compare`."""

    def __init__(self) -> None:
        self.snapshot: dict[str, torch.Tensor] | None = None

    def handle(self, params: dict[str, torch.Tensor], req: CheckWeightsReq) -> dict[str, Any]:
        """Run `req` on the engine's live weights (between two steps); the answer's extra fields."""
        if req.selector == "draft":
            return {}
        action = req.action
        if action == "snapshot":
            self.snapshot = {name: t.detach().clone() for name, t in params.items()}
        elif action == "reset_tensors":
            with torch.no_grad():
                for name, t in params.items():
                    if not _skipped(name, req.skip_tensor_list):
                        t.copy_(torch.rand(t.shape, dtype=torch.float32).to(t.dtype))
        elif action == "compare":
            self._compare(params, req.skip_tensor_list)
        elif action == "checksum":
            checksums = {n: _digest(t) for n, t in params.items() if not _skipped(n, req.skip_tensor_list)}
            per_gpu = _overall(checksums)
            info = {
                "checksums": checksums,
                "per_gpu_checksum": per_gpu,
                "parallelism_info": {
                    "role": "target",
                    "tp_rank": 0,
                    "tp_size": 1,
                    "dp_rank": 0,
                    "dp_size": 1,
                    "pp_rank": 0,
                    "pp_size": 1,
                    "rank": 0,
                    "size": 1,
                },
            }
            return {"ranks": [info], "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()}
        else:
            raise WeightsCheckFailed(f"Unsupported action={action!r}")
        return {}

    def _compare(self, params: dict[str, torch.Tensor], skip: list[str] | None) -> None:
        if self.snapshot is None:
            raise WeightsCheckFailed("compare: no snapshot to compare with (call action=snapshot first)")
        if params.keys() != self.snapshot.keys():
            missing = sorted(self.snapshot.keys() - params.keys())
            extra = sorted(params.keys() - self.snapshot.keys())
            raise WeightsCheckFailed(f"compare: the weights differ by name (missing {missing}, new {extra})")
        errors = []
        for name, expect in self.snapshot.items():
            if _skipped(name, skip):
                continue
            actual = params[name]
            if actual.shape != expect.shape:
                raise WeightsCheckFailed(
                    f"expect_dq.shape={expect.shape} actual_dq.shape={actual.shape} ({name})"
                )
            diff = (actual.float() - expect.float()).abs()
            if bool(torch.all(diff == 0)):
                continue
            exceed = int((~(diff <= 0.0)).sum())  # NaN counts as exceeding, as in SGLang
            errors.append(
                f"name={name} max_abs_err={float(diff.max())} mean_abs_err={float(diff.mean())} "
                f"num_exceed={exceed} expect=raw(shape={tuple(expect.shape)} dtype={expect.dtype}) "
                f"actual=raw(shape={tuple(actual.shape)} dtype={actual.dtype}) "
            )
        if errors:
            raise WeightsCheckFailed("check tensor equality failed:\n" + "\n".join(errors))
        self.snapshot = None
