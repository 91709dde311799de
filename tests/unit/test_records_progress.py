"""The run's progress display: rich bars on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

import pytest

from tether.records.progress import RunProgress


def test_plain_progress_prints_each_step_and_message(capsys: pytest.CaptureFixture[str]) -> None:
    progress = RunProgress(3, 0, "plain")
    progress.phase("rollout 1")  # no bar: nothing printed
    progress.step_done(0, {"rollout/reward_mean": 0.5, "train/loss": 1.25})
    progress.message("hello")
    progress.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[tether] step 1/3") and "reward_mean=0.5" in out[0] and "loss=1.25" in out[0]
    assert out[1] == "[tether] hello"


def test_rich_progress_draws_bars_and_prints_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bars' console writes to the process's stdout, as before rich was imported lazily."""
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    progress = RunProgress(3, 1, "rich")
    progress.phase("train step 2")
    progress.step_done(1, {"train/loss": 0.75})
    progress.message("a message above the bars")
    progress.close()
    text = out.getvalue()
    assert "a message above the bars" in text and "2/3" in text and "loss=0.75" in text
    assert "[tether] step" not in text  # the bars, not the plain lines
