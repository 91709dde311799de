"""No flag is accepted and left unused: every flag `tether run --help` lists is read by product code
outside the modules that declare the configuration, or is named below with where its value goes.

The walk parses every product module (the benchmarks and the config modules left out) and
collects the attribute names it reads, the keywords it passes and the strings it looks names up
by; a flag whose field appears in none of them was declared and never used. Megatron's flags are
also checked by behaviour (tests/unit/test_train_megatron_args.py builds the config each one sets).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tether.config import flag_specs, help_text

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("head", "rollout", "train", "sync", "runtime", "placement")
CONFIG_MODULES = {"head/config.py", "rollout/config.py", "train/config.py", "sync/config.py"}

# Fields read only inside the config modules (a property or a check there is where they act), or
# only by users' hooks through `args`. Each names where its value goes; the test checks the place
# exists.
USED_IN_CONFIG: dict[str, tuple[str, str]] = {
    "loss_mask_type": (
        "rollout/config.py",
        "read by hooks as args.loss_mask_type (slime's MultiTurnLossMaskGenerator)",
    ),
    "num_steps_per_rollout": ("rollout/config.py", "DataConfig.resolved_global_batch_size"),
    "eval_prompt_data": ("rollout/config.py", "DataConfig.eval_datasets"),
    "eps_clip_high": ("train/config.py", "AlgorithmConfig's upper clip bound property"),
    "lambd": ("train/config.py", "refused unless 1.0: GAE's lambda has no estimator in tether"),
    "lr_decay_iters": ("train/config.py", "MegatronConfig's LR schedule horizon"),
    "spec": ("train/config.py", "check_layer_spec: slime's GLM-4 spec is what tether builds; others refused"),
    "no_position_embedding": (
        "train/config.py",
        "MegatronConfig refuses it without rotary embeddings, as Megatron-LM",
    ),
}


def _names_used() -> dict[str, set[str]]:
    """Every attribute, keyword and string constant of the product modules, with the modules."""
    used: dict[str, set[str]] = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in CONFIG_MODULES or rel.startswith("head/bench/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                name = None
                if isinstance(node, ast.Attribute):
                    name = node.attr
                elif isinstance(node, ast.keyword):
                    name = node.arg
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    name = node.value
                if name:
                    used.setdefault(name, set()).add(rel)
    return used


def test_every_flag_in_help_is_used_or_says_where_it_goes() -> None:
    shown = help_text()
    specs = flag_specs()
    assert [s.flag for s in specs if s.flag not in shown] == []  # the walk covers what --help shows
    used = _names_used()
    unused = [s.flag for s in specs if s.field not in used and s.field not in USED_IN_CONFIG]
    assert unused == [], (
        f"flags declared but never read: {unused}; use them, refuse them, or say where they go"
    )
    for field, (module, _why) in USED_IN_CONFIG.items():
        assert field in {s.field for s in specs}, f"{field} is no longer a flag: drop it from USED_IN_CONFIG"
        source = (ROOT / module).read_text()
        assert source.count(f"self.{field}") + source.count(f".{field}") >= 1, (field, module)
