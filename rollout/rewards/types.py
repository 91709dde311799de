"""The reward types --rm-type and slime's rm_hub name, and what each needs installed.

Names only (standard library): the config checks a type at parse time without importing the
scorers (tether.rollout.rewards.rules, tether.rollout.rewards.scoring).
"""

from __future__ import annotations

import importlib.util

RULE_TYPES = ("math", "deepscaler", "dapo", "f1", "gpqa", "ifbench", "random")
"""slime's rule-based reward types."""
BASE_TYPES = (*RULE_TYPES, "exact_match", "remote_rm")
"""Every reward type tether's --rm-type and slime's rm_hub answer (each also as boxed_<type>)."""
IFBENCH_MODULE = "evaluation_lib"


def split_rm_type(rm_type: str) -> tuple[str, bool]:
    """(base type, whether the response is first reduced to its last \\boxed{} contents)."""
    kind = rm_type.strip()
    if kind.startswith("boxed_"):
        return kind[len("boxed_") :], True
    return kind, False


def missing_requirement(rm_type: str) -> str | None:
    """What a reward type needs that is not installed here; None when it can be scored."""
    base, _ = split_rm_type(rm_type)
    if base == "ifbench" and importlib.util.find_spec(IFBENCH_MODULE) is None:
        return (
            f"needs IFBench's `{IFBENCH_MODULE}` module (the allenai/IFBench repository on PYTHONPATH, "
            "with its requirements), which is not installed here"
        )
    return None
