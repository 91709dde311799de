"""`slime.rollout.rm_hub.ifbench`: IFBench's strict instruction-following check as a reward.

Like slime's module, this one needs IFBench's `evaluation_lib` when it is imported. slime clones
allenai/IFBench next to its checkout and pip-installs its requirements at that point, and raises
ImportError when it cannot; tether installs nothing, so importing this module without
`evaluation_lib` importable raises ModuleNotFoundError saying what to put on the path.
"""

from __future__ import annotations

import importlib
from typing import Any

from tether.rollout.rewards.rules import ifbench_score
from tether.rollout.rewards.types import IFBENCH_MODULE, missing_requirement

_missing = missing_requirement("ifbench")
if _missing is not None:
    raise ModuleNotFoundError(f"slime.rollout.rm_hub.ifbench {_missing}", name=IFBENCH_MODULE)

evaluation_lib = importlib.import_module(IFBENCH_MODULE)
InputExample = evaluation_lib.InputExample

JsonDict = dict[str, Any]
KwargsDict = dict[str, str | int | float | None]


def compute_ifbench_reward(response: str | None, label: Any, metadata: JsonDict | None = None) -> float:
    """1.0 when the response follows every instruction in metadata `instruction_id_list` (with its
    `kwargs`, `prompt_text`, `record_id`), by IFBench's strict check; 0.0 otherwise or without
    metadata or instructions. The label is not used."""
    return ifbench_score(response, metadata)
