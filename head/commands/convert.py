"""`tether convert`: Hugging Face ↔ Megatron checkpoints, as slime's conversion tools do.

    tether convert hf-to-megatron --hf-checkpoint HF_DIR --save DIR [--nproc N]
        DIR/latest_checkpointed_iteration.txt = "release" and DIR/release/, a torch_dist
        checkpoint of the model's weights (the layout slime's convert_hf_to_torch_dist.py
        writes; --load/--ref-load read it, at any TP/PP).
    tether convert megatron-to-hf --load DIR --hf-checkpoint HF_DIR --output OUT [--nproc N]
        the weights of DIR's checkpoint (any layout --load reads) as safetensors in OUT, with the
        config and tokenizer files of HF_DIR (the model the checkpoint was made from).

The ranks run under torchrun (one by default); with --nproc N the model is split into N
pipeline stages, so each process holds 1/N of the layers (for models that do not fit one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tether.runtime.errors import ConfigError

_WORKER_FLAG = "--rank-work"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_mg = sub.add_parser(
        "hf-to-megatron",
        help="HF model directory -> Megatron torch_dist checkpoint (slime's release layout).",
        description="Write DIR/latest_checkpointed_iteration.txt ('release') and DIR/release/.",
    )
    to_mg.add_argument("--hf-checkpoint", required=True, type=Path, help="The HF model directory to convert.")
    to_mg.add_argument("--save", required=True, type=Path, help="Directory to write the checkpoint into.")
    to_hf = sub.add_parser(
        "megatron-to-hf",
        help="Megatron checkpoint -> HF safetensors with the source model's config and tokenizer.",
        description="Write the weights of --load's checkpoint as an HF model directory.",
    )
    to_hf.add_argument("--load", required=True, type=Path, help="The Megatron checkpoint (any layout).")
    to_hf.add_argument(
        "--hf-checkpoint",
        required=True,
        type=Path,
        help="The HF model the checkpoint was made from: its config and tokenizer files are copied.",
    )
    to_hf.add_argument("--output", required=True, type=Path, help="Directory to write the HF model into.")
    for p in (to_mg, to_hf):
        p.add_argument(
            "--nproc",
            type=int,
            default=1,
            help="Processes (pipeline stages) to split the model over; it must divide its layer count.",
        )


def check(args: argparse.Namespace) -> None:
    """Refuse bad paths and counts before any process starts, naming the flag."""
    if args.nproc < 1:
        raise ConfigError("--nproc", args.nproc, "must be >= 1")
    hf = Path(args.hf_checkpoint)
    if not (hf / "config.json").is_file():
        raise ConfigError(
            "--hf-checkpoint", str(hf), "has no config.json (not a Hugging Face model directory)"
        )
    if args.direction == "hf-to-megatron":
        if not any(hf.glob("*.safetensors")):
            raise ConfigError("--hf-checkpoint", str(hf), "has no *.safetensors weights")
        save = Path(args.save)
        if save.exists() and any(save.iterdir()):
            raise ConfigError("--save", str(save), "is not empty; convert into a new directory")
        _creatable("--save", save)
    else:
        from tether.train.checkpoint.layout import holds_megatron_checkpoint

        if not holds_megatron_checkpoint(Path(args.load)):
            raise ConfigError("--load", str(args.load), "holds no Megatron checkpoint")
        out = Path(args.output)
        if out.exists() and any(out.iterdir()):
            raise ConfigError("--output", str(out), "is not empty; write into a new directory")
        _creatable("--output", out)


def _creatable(flag: str, path: Path) -> None:
    """Create the (empty) output directory now: a path the ranks cannot write is refused here,
    naming its flag, not as a traceback from every rank after the model is loaded."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(flag, str(path), f"cannot be created: {exc.strerror or exc}") from exc


def main(args: argparse.Namespace) -> int:
    check(args)  # a refusal is one line from the CLI (tether.runtime.errors.exit_on_user_error)
    job = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "tether.commands.convert",
        _WORKER_FLAG,
        json.dumps(job),
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    rc = subprocess.run(cmd, env=env, check=False).returncode
    if rc == 0:
        where = args.save if args.direction == "hf-to-megatron" else args.output
        print(f"tether convert: wrote {where}")
    else:
        print(
            f"tether convert: {args.direction} failed (exit {rc}); see the ranks' output above",
            file=sys.stderr,
        )
    return rc


def _hf_dtype(hf_dir: Path) -> Any:
    """The dtype the HF model's config declares (its weights go back out in it)."""
    import torch

    cfg = json.loads((hf_dir / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")  # transformers' newer key first
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) else None


def rank_work(job: dict[str, Any]) -> None:
    """One rank's part of a conversion (under torchrun): pipeline stage RANK of WORLD_SIZE."""
    import torch

    from tether.train.checkpoint import export
    from tether.train.checkpoint import load_save as checkpoint
    from tether.train.config import MegatronConfig
    from tether.train.model import build as model
    from tether.train.parallel import topology as parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    hf = Path(job["hf_checkpoint"])
    topo = parallel.init_distributed(tensor_parallel=1, pipeline_parallel=world)
    dtype = _hf_dtype(hf)
    # The checkpoint keeps the HF weights' precision (slime's converter runs with the model's --bf16).
    precision = MegatronConfig(
        lr_decay_style="constant", bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16
    )
    opts = model.ModelOptions(hf_checkpoint=str(hf), megatron=precision)
    try:
        if job["direction"] == "hf-to-megatron":
            ref = model.build_reference(opts, topo)
            checkpoint.save_release(ref.chunks, ref.config, job["save"])
        else:
            ref = model.build_reference(opts, topo, load_weights=False)
            checkpoint.load_weights_only(ref.chunks, job["load"])
            export.save_hf(ref.chunks, ref.arch, topo, job["output"], base_dir=hf, dtype=dtype)
    finally:
        parallel.destroy()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == _WORKER_FLAG:
        rank_work(json.loads(sys.argv[2]))
    else:
        raise SystemExit(f"usage: tether convert --help (this module's {_WORKER_FLAG} is for its ranks)")
