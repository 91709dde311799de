"""Where checkpoints are on disk, and which one a run starts from: pure path logic, no torch.

Three layouts of one checkpoint directory (`iter_0000012/`, or `release/`) are read:

    MEGATRON  Megatron-LM's own: the directory is a megatron.core.dist_checkpointing `torch_dist`
              checkpoint (metadata.json, .metadata, common.pt, __R_N.distcp). Written by
              Megatron-LM, by slime (and its HF→torch_dist converter, which names it `release/`).
    TETHER    what tether writes: a MEGATRON directory plus `tether/` with the run state
              (tether/run_state.msgpack), per-rank RNG (tether/rng/) and the digests of every
              file (tether/digests.msgpack). Megatron-LM and slime load it as MEGATRON.
    LEGACY    what tether wrote before: `model_optim/` (the torch_dist checkpoint),
              `run_state.msgpack`, `rng/`, `digests.msgpack` at the top.

A checkpoint root (--save, --load) names its newest checkpoint with Megatron-LM's tracker
`latest_checkpointed_iteration.txt` ("12" → iter_0000012, "release" → release/); LEGACY roots
with `latest`. --load may also name one checkpoint directory itself.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_TRACKER = "latest"
RELEASE = "release"
TETHER_DIR = "tether"
RUN_STATE = "run_state.msgpack"
DIGESTS = "digests.msgpack"
RNG_DIR = "rng"
LEGACY_MODEL_DIR = "model_optim"
DIST_MARKER = "metadata.json"  # dist_checkpointing's marker of a distributed checkpoint
ITER_RE = re.compile(r"^iter_(\d{7})$")


class Layout(enum.Enum):
    MEGATRON = "megatron"
    TETHER = "tether"
    LEGACY = "tether-legacy"


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def layout_of(path: Path) -> Layout | None:
    """The layout of checkpoint directory `path`, None when it holds no (complete) checkpoint.

    TETHER and LEGACY directories are complete once their run state is there (a save renames a
    directory into place only after writing it); a MEGATRON one once its torch_dist marker is.
    """
    if (path / LEGACY_MODEL_DIR).is_dir() and (path / RUN_STATE).is_file():
        return Layout.LEGACY
    if not (path / DIST_MARKER).is_file():
        return None
    if (path / TETHER_DIR / RUN_STATE).is_file():
        return Layout.TETHER
    return Layout.MEGATRON


def model_dir(path: Path) -> Path:
    """The torch_dist checkpoint inside checkpoint directory `path`."""
    return path / LEGACY_MODEL_DIR if layout_of(path) is Layout.LEGACY else path


def state_dir(path: Path) -> Path:
    """Where a checkpoint's run state, RNG and digests are (none for MEGATRON)."""
    return path if layout_of(path) is Layout.LEGACY else path / TETHER_DIR


def digests_name(path: Path) -> str:
    """The digests file of checkpoint `path`, relative to it."""
    return DIGESTS if layout_of(path) is Layout.LEGACY else f"{TETHER_DIR}/{DIGESTS}"


def parse_tracker(text: str, file: Path | str = TRACKER) -> int | None:
    """The iteration a tracker file names; None for "release". ValueError for anything else."""
    value = text.strip()
    if value == RELEASE:
        return None
    if value.isdigit():
        return int(value)
    raise ValueError(f"{file}: {value[:40]!r} is neither an iteration number nor 'release'")


def tracker_target(root: Path) -> Path | None:
    """The checkpoint directory root's tracker names (Megatron-LM's, else tether's older
    `latest`), or None when there is no readable tracker. It may not exist or be incomplete."""
    for name in (TRACKER, LEGACY_TRACKER):
        file = root / name
        if not file.is_file():
            continue
        try:
            step = parse_tracker(file.read_text(), file)
        except (OSError, ValueError) as exc:
            log.warning("ignoring tracker %s: %s", file, exc)
            continue
        if step is None:
            if name == LEGACY_TRACKER:
                continue
            return root / RELEASE
        return root / iter_dir_name(step)
    return None


def is_checkpoint_dir(path: Path) -> bool:
    """`path` is itself one checkpoint (`iter_XXXXXXX` or `release`), not a root of several."""
    return (ITER_RE.match(path.name) is not None or path.name == RELEASE) and layout_of(path) is not None


def iteration_of(path: Path) -> int | None:
    """The iteration of a checkpoint directory's name; None for `release`."""
    m = ITER_RE.match(path.name)
    return int(m.group(1)) if m else None


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints tether wrote under root (TETHER or LEGACY), ascending.
    MEGATRON directories are left out: nothing says whether another tool finished writing one,
    so only a tracker naming it (or the user naming it) makes it a candidate."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = ITER_RE.match(entry.name)
        if m and entry.is_dir() and layout_of(entry) in (Layout.TETHER, Layout.LEGACY):
            steps.append(int(m.group(1)))
    return sorted(steps)


def first_candidate(root: Path) -> Path | None:
    """The checkpoint a load from `root` tries first: root itself when it is one checkpoint;
    else the one the tracker names when complete; else the newest complete one tether wrote."""
    if is_checkpoint_dir(root):
        return root
    named = tracker_target(root)
    complete = complete_steps(root)
    if named is not None and layout_of(named) is not None:
        return named
    if named is not None and complete:
        log.warning(
            "the tracker in %s names %s, which holds no complete checkpoint; loading the newest "
            "complete one, step %d",
            root,
            named.name,
            complete[-1],
        )
    return root / iter_dir_name(complete[-1]) if complete else None


def candidates(root: Path) -> list[Path]:
    """Checkpoints in the order a load tries them: `first_candidate`, then the other complete
    ones tether wrote, newest first (a damaged newest one falls back to an older one)."""
    first = first_candidate(root)
    if first is None:
        return []
    if first == root:
        return [root]
    rest = [root / iter_dir_name(step) for step in reversed(complete_steps(root))]
    return [first, *(p for p in rest if p != first)]


def select_checkpoint_step(load_dir: str | Path, step: int | None, *, flag: str = "--ckpt-step") -> Path:
    """What a load with a step flag (--ckpt-step, --ref-ckpt-step, --opd-teacher-ckpt-step) reads:
    `iter_{step}` of the checkpoint root instead of the one its tracker names, as Megatron-LM and
    slime pick it (`get_load_checkpoint_path_by_args`). A `load_dir` that is itself one checkpoint
    directory stands for its parent root. A step of None or 0 selects nothing (Megatron and slime
    test the flag for truth): `load_dir` comes back as it is, for the usual choice.

    FileNotFoundError names `flag` when that directory holds no complete checkpoint (a named step
    does not fall back to another one).
    """
    root = Path(load_dir)
    if not step:
        return root
    if is_checkpoint_dir(root) or ITER_RE.match(root.name) or root.name == RELEASE:
        root = root.parent
    chosen = root / iter_dir_name(step)
    if layout_of(chosen) is None:
        found = ", ".join(p.name for p in sorted(root.glob("iter_*")) if ITER_RE.match(p.name)) or "none"
        raise FileNotFoundError(
            f"{flag}={step}: {chosen} holds no complete checkpoint (checkpoints in {root}: {found})"
        )
    return chosen


def holds_megatron_checkpoint(path: Path) -> bool:
    """`path` holds a checkpoint to resume from, in any layout: slime's test (a tracker file, or
    an `iter_XXXXXXX` directory), tether's older `latest`, or a complete checkpoint directory."""
    if not path.is_dir():
        return False
    if (path / TRACKER).is_file() or is_checkpoint_dir(path):
        return True
    return first_candidate(path) is not None


def is_hf_checkpoint(path: Path) -> bool:
    """A Hugging Face model directory: config.json and safetensors weights."""
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
        and not holds_megatron_checkpoint(path)
    )


class StartKind(enum.Enum):
    RESUME = "resume"  # --load (or --save with --auto-resume) holds a Megatron checkpoint
    HF_LOAD = "hf-load"  # --load is an HF directory: its weights, fresh run
    REF_LOAD = "ref-load"  # the actor starts from --ref-load's weights, fresh run
    HF_CHECKPOINT = "hf-checkpoint"  # nothing to load: --hf-checkpoint's weights


@dataclass(frozen=True)
class StartChoice:
    """Where the actor's weights come from at the start of a run, and why."""

    kind: StartKind
    path: str | None
    flag: str | None  # the flag that named `path`
    reason: str
    hf: bool = False  # `path` is a Hugging Face model directory (weights only)

    @property
    def finetune(self) -> bool:
        """Weights only: no optimizer, scheduler, RNG or run position."""
        return self.kind in (StartKind.HF_LOAD, StartKind.REF_LOAD)


def start_attempts(
    load: str | None,
    ref_load: str | None,
    *,
    auto_resume: bool = False,
    save: str | None = None,
    load_is_hf: bool | None = None,
) -> list[StartChoice]:
    """What the actor starts from, as slime's slime_validate_args picks it: the loads to try in
    order until one finds a checkpoint (none: --hf-checkpoint's weights).

    `--load` holding a Megatron checkpoint (any layout above) resumes from it; `--load` an HF
    directory starts fresh from its weights; otherwise `--ref-load` (weights only, step 0). With
    --auto-resume and no --load, `--save` is tried as --load (it holds the run's own checkpoints
    once there are any). Whether a directory holds a checkpoint is the trainer ranks' to say
    (they may see a file system the head does not), so a resume comes first and --ref-load
    follows when it finds nothing. `load_is_hf`: whether --load is an HF directory (looked at
    here when None).
    """
    attempts: list[StartChoice] = []
    if load is not None:
        if is_hf_checkpoint(Path(load)) if load_is_hf is None else load_is_hf:
            why = f"--load={load} is a Hugging Face model"
            return [StartChoice(StartKind.HF_LOAD, load, "--load", why, hf=True)]
        attempts.append(StartChoice(StartKind.RESUME, load, "--load", f"--load={load}"))
    elif auto_resume and save is not None:
        attempts.append(StartChoice(StartKind.RESUME, save, "--save", f"--auto-resume from --save={save}"))
    if ref_load is not None:
        why = "no --load" if not attempts else f"{attempts[0].flag} holds no checkpoint"
        # The reference may be an HF directory too: then its weights are loaded as HF weights.
        ref_hf = is_hf_checkpoint(Path(ref_load))
        attempts.append(
            StartChoice(
                StartKind.REF_LOAD, ref_load, "--ref-load", f"{why}: starting from --ref-load", hf=ref_hf
            )
        )
    return attempts


def choose_start(
    load: str | None, ref_load: str | None, *, auto_resume: bool = False, save: str | None = None
) -> StartChoice:
    """`start_attempts`' answer as the file system here shows it: the first attempt whose
    directory holds a checkpoint (or is an HF model), else --hf-checkpoint's weights."""
    for choice in start_attempts(load, ref_load, auto_resume=auto_resume, save=save):
        assert choice.path is not None
        if choice.kind is not StartKind.RESUME or holds_megatron_checkpoint(Path(choice.path)):
            return choice
    why = "no --load" if load is None else f"--load={load} holds no checkpoint"
    return StartChoice(StartKind.HF_CHECKPOINT, None, None, f"{why}: starting from --hf-checkpoint")


def save_hf_path(template: str, rollout_id: int) -> str:
    """--save-hf's directory for a checkpoint of step `rollout_id`: slime's
    `save_hf.format(rollout_id=...)` (a template without the field names one directory, rewritten
    at every save). ConfigError names the flag for a template `format` cannot fill."""
    from tether.runtime.errors import ConfigError

    try:
        return template.format(rollout_id=rollout_id)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ConfigError(
            "--save-hf", template, f"is formatted with rollout_id= only (as slime does): {exc!r}"
        ) from None


def critic_checkpoint_dir(save_dir: str | Path) -> Path:
    """Where the critic's checkpoints go: `critic/` under the actor's --save (slime's critic
    inherits --save and would write over the actor's; its role YAML is not implemented here)."""
    return Path(save_dir) / "critic"
