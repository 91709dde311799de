"""slime's examples/retool/generate_with_retool.py, unchanged, as a --custom-rm-path hook: its
`reward_func` imports `compute_score` from `slime.rollout.rm_hub.math_dapo_utils` and scores with
`strict_box_verify=True`. The file (and the tool_sandbox.py it imports) are read from slime's source
(git show; skipped where it is not at hand), never copied into this tree. Starts `git` only."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.slime_source import slime_file

from tether.rollout.hooks.calls import load_function
from tether.rollout.slime_api import finder
from tether.rollout.slime_api.utils.types import Sample


@pytest.fixture
def retool_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`reward_func` of slime's retool example, loaded as tether loads a --custom-rm-path hook."""
    pytest.importorskip("jinja2")
    pytest.importorskip("psutil")
    hook = slime_file("examples/retool/generate_with_retool.py", tmp_path / "generate_with_retool.py")
    slime_file("examples/retool/tool_sandbox.py", tmp_path / "tool_sandbox.py")
    monkeypatch.syspath_prepend(str(tmp_path))  # the example imports its sibling tool_sandbox
    yield load_function(f"{hook}:reward_func", "--custom-rm-path")
    sys.modules.pop("tool_sandbox", None)
    finder.uninstall()


def test_retools_reward_runs_unchanged(retool_reward: Any) -> None:
    prompt = "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n"
    right = Sample(prompt=prompt, response="6 * 7 = 42.\n\nAnswer: \\boxed{42}", label="42")
    assert asyncio.run(retool_reward(None, right)) == {"score": 1.0, "acc": True, "pred": "42"}
    # wrong: -1, plus 0.1 per two tool calls beyond two, capped at -0.6 (retool's shaping)
    wrong = Sample(prompt=prompt, response="Answer: \\boxed{41}", label="42")
    result = asyncio.run(retool_reward(None, wrong))
    assert result["acc"] is False and result["pred"] == "41"
    assert result["score"] == pytest.approx(-1.1)  # no tool calls: -1 + (0 - 2) / 2 * 0.1
    wrong.tool_call_count = 6  # type: ignore[attr-defined]
    assert asyncio.run(retool_reward(None, wrong))["score"] == pytest.approx(-0.8)
    # no boxed answer: pred None becomes ""
    unboxed = Sample(prompt=prompt, response="Answer: 42", label="42")
    assert asyncio.run(retool_reward(None, unboxed)) == {
        "score": pytest.approx(-1.1),
        "acc": False,
        "pred": "",
    }
