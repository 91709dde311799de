"""The on-policy distillation teacher on the trainer ranks (--use-opd --opd-type megatron).

A frozen model with the actor's architecture (as slime's teacher, loaded into the actor's model
shape), sharded like the reference model, its weights from --opd-teacher-load: a Megatron
checkpoint directory (its newest complete checkpoint, or iter_<--opd-teacher-ckpt-step>) or an
HF model directory. Its log-probs over the responses are the step's "teacher" log-probs
(`tether.train.rank.work`); nothing of it trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig


def teacher_checkpoint(algorithm: AlgorithmConfig) -> Path:
    """The directory the teacher's weights load from: iter_<step> with --opd-teacher-ckpt-step
    (Megatron's iteration directory name), else --opd-teacher-load itself."""
    if algorithm.opd_teacher_load is None:
        raise ConfigError("--opd-teacher-load", None, "is required by --opd-type megatron")
    root = Path(algorithm.opd_teacher_load)
    step = algorithm.opd_teacher_ckpt_step
    return root if step is None else root / f"iter_{step:07d}"


def build_teacher(opts: Any, topo: Any, algorithm: AlgorithmConfig) -> Any:
    """Build and load the teacher (collective over every rank); a `tether.train.model.build.Reference`."""
    from tether.train.checkpoint import load_save as checkpoint
    from tether.train.checkpoint.layout import is_hf_checkpoint
    from tether.train.model import build as model

    path = teacher_checkpoint(algorithm)
    teacher = model.build_reference(opts, topo, load_weights=False)
    if algorithm.opd_teacher_ckpt_step is None and is_hf_checkpoint(path):
        model.load_hf_weights(teacher.chunks, teacher.arch, path, topo, teacher.weights)
        return teacher
    try:
        checkpoint.load_weights_only(teacher.chunks, path)
    except FileNotFoundError as exc:
        flag, value = (
            ("--opd-teacher-load", algorithm.opd_teacher_load)
            if algorithm.opd_teacher_ckpt_step is None
            else ("--opd-teacher-ckpt-step", algorithm.opd_teacher_ckpt_step)
        )
        raise ConfigError(flag, value, f"no loadable teacher checkpoint at {path}: {exc}") from exc
    return teacher


__all__ = ["build_teacher", "teacher_checkpoint"]
