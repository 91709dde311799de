"""slime's CI checks (--ci-test, --ci-save-grad-norm, --ci-load-grad-norm) as run-time assertions.

slime asserts them inside its train loop; here the head checks each rollout's log-prob passes,
each optimizer step's metrics and each weight update, and a failure stops the run with one line
naming the check and the values (`CiCheckFailed`, a user error: the run was asked to stop on it).
Grad norms are files as slime writes them (`torch.save` of a float) so either side's can be
compared.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tether.runtime.errors import ConfigError, UserError

THRESHOLD_DEFAULT = 0.1  # slime's --ci-train-rollout-logprob-abs-diff-threshold
KL_TOLERANCE = 1e-8  # slime: KL at the first step of the weights that sampled must be (nearly) zero
GRAD_NORM_REL, GRAD_NORM_ABS = 0.01, 0.01  # slime's math.isclose tolerances
TEMPLATE_KEYS = {"role": "actor", "rollout_id": 0, "step_id": 0}


class CiCheckFailed(UserError):
    """A check the run was asked to make (--ci-test, --ci-load-grad-norm) failed."""


def check_grad_norm_template(flag: str, template: str) -> None:
    """A grad-norm path template may use {role}, {rollout_id} and {step_id}, nothing else."""
    try:
        template.format(**TEMPLATE_KEYS)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            flag, template, f"is not a path template over {{role}}, {{rollout_id}}, {{step_id}}: {exc!r}"
        ) from exc


@dataclass(frozen=True)
class CiOptions:
    """The flags the checks read (from the run's DebugConfig and AlgorithmConfig)."""

    ci_test: bool = False
    kl_checker: bool = True  # not --ci-disable-kl-checker
    logprob_abs_diff_threshold: float = THRESHOLD_DEFAULT
    save_grad_norm: str | None = None
    load_grad_norm: str | None = None
    rollout_routing_replay: bool = False  # R3: the reference routes on its own; KL starts above 0

    @property
    def any(self) -> bool:
        return self.ci_test or self.save_grad_norm is not None or self.load_grad_norm is not None


class CiChecks:
    """What slime's train loop asserts, at the same points (`tether.train.rank.rollout_calls` calls
    `rollout_data` once a rollout's log-prob passes are in, and `step` after each optimizer step)."""

    def __init__(self, options: CiOptions) -> None:
        self.options = options

    def rollout_data(self, rollout_id: int, metrics: Mapping[str, float]) -> None:
        """slime's log_rollout_data checks: at rollout 0 the actor's log-probs equal the reference's
        (same weights), a mean log-prob in (-1, 0), a mean entropy in (0, 1)."""
        opts = self.options
        if not opts.ci_test:
            return
        log_probs, ref = metrics.get("rollout/log_probs"), metrics.get("rollout/ref_log_probs")
        if rollout_id == 0 and opts.kl_checker and not opts.rollout_routing_replay:
            if log_probs is not None and ref is not None and not abs(log_probs - ref) < KL_TOLERANCE:
                self._fail(
                    f"rollout 0: the actor's mean log-prob {log_probs!r} differs from the reference's {ref!r} "
                    f"(same weights; the difference must be < {KL_TOLERANCE})"
                )
        if log_probs is not None and not -1.0 < log_probs < 0.0:
            self._fail(f"rollout {rollout_id}: rollout/log_probs={log_probs!r} is outside (-1, 0)")
        entropy = metrics.get("rollout/entropy")
        if entropy is not None and not 0.0 < entropy < 1.0:
            self._fail(f"rollout {rollout_id}: rollout/entropy={entropy!r} is outside (0, 1)")

    def step(
        self, role: str, rollout_id: int, step_id: int, steps_per_rollout: int, metrics: Mapping[str, float]
    ) -> None:
        """After one optimizer step, with its metrics by tether's names (no `train/` prefix)."""
        opts = self.options
        grad_norm = float(metrics.get("grad_norm", math.nan))
        if opts.ci_test and role == "actor":
            self._step_checks(rollout_id, step_id, steps_per_rollout, metrics)
        keys = {"role": role, "rollout_id": rollout_id, "step_id": step_id}
        if opts.save_grad_norm is not None:
            save_grad_norm(Path(opts.save_grad_norm.format(**keys)), grad_norm)
        elif opts.load_grad_norm is not None:
            path = Path(opts.load_grad_norm.format(**keys))
            want = load_grad_norm(path)
            if not math.isclose(grad_norm, want, rel_tol=GRAD_NORM_REL, abs_tol=GRAD_NORM_ABS):
                self._fail(
                    f"{role} rollout {rollout_id} step {step_id}: grad norm {grad_norm!r} differs from "
                    f"{want!r} saved in {path} (--ci-load-grad-norm)"
                )

    def _step_checks(
        self, rollout_id: int, step_id: int, steps_per_rollout: int, metrics: Mapping[str, float]
    ) -> None:
        opts = self.options
        where = f"rollout {rollout_id} step {step_id}"
        diff = metrics.get("train_rollout_logprob_abs_diff")
        if diff is not None and not diff <= opts.logprob_abs_diff_threshold:
            self._fail(
                f"{where}: train/train_rollout_logprob_abs_diff={diff!r} exceeds "
                f"--ci-train-rollout-logprob-abs-diff-threshold={opts.logprob_abs_diff_threshold!r}"
            )
        if not opts.kl_checker:
            return
        ppo_kl = metrics.get("ppo_kl")
        if step_id == 0 and ppo_kl is not None and "pg_clipfrac" in metrics and not ppo_kl < KL_TOLERANCE:
            self._fail(
                f"{where}: train/ppo_kl={ppo_kl!r} on the weights that sampled must be < {KL_TOLERANCE}"
            )
        kl_loss = metrics.get("kl_loss")
        first = rollout_id * steps_per_rollout + step_id == 0
        if first and not opts.rollout_routing_replay and kl_loss is not None and not kl_loss < KL_TOLERANCE:
            self._fail(f"{where}: train/kl_loss={kl_loss!r} at the first step must be < {KL_TOLERANCE}")

    def weights(self, version: int, engine_versions: Mapping[str, int | None]) -> None:
        """After a weight update: every engine serves the version just published."""
        if not self.options.ci_test:
            return
        behind = {url: v for url, v in engine_versions.items() if v != version}
        if behind:
            self._fail(f"after publishing version {version}, engines report other versions: {behind}")

    @staticmethod
    def _fail(message: str) -> None:
        raise CiCheckFailed(f"--ci-test check failed: {message}")


def save_grad_norm(path: Path, grad_norm: float) -> None:
    """torch.save of the float, as slime writes it; atomically (a crash leaves no half file)."""
    import torch  # the head imports torch only when this flag is used

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(grad_norm, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def load_grad_norm(path: Path) -> float:
    import torch

    if not path.is_file():
        raise CiCheckFailed(f"--ci-load-grad-norm: no saved grad norm at {path}")
    value = torch.load(path, weights_only=True)
    if isinstance(value, torch.Tensor):
        value = value.item()
    if not isinstance(value, (int, float)):
        raise CiCheckFailed(f"--ci-load-grad-norm: {path} holds {type(value).__name__}, not a grad norm")
    return float(value)
