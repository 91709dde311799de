"""`exit_on_user_error`: the user's mistakes become one line and exit status 2; bugs keep their
traceback (the CLI as a user drives it: tests/integration/test_cli_errors.py)."""

from __future__ import annotations

import pytest

from tether.runtime.errors import DEBUG_ENV, ConfigError, RemoteError, UserError, exit_on_user_error


def fails(exc: BaseException) -> int:
    raise exc


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ConfigError("--threads", 0, "must be at least 1"), "tether x: --threads=0: must be at least 1\n"),
        (ConfigError("--api-key-file", None, "set a key"), "tether x: --api-key-file: set a key\n"),
        (UserError("a.yaml: broken\n  at line 2\n"), "tether x: a.yaml: broken at line 2\n"),
        (
            FileNotFoundError(2, "No such file or directory", "/m"),
            "tether x: /m: No such file or directory\n",
        ),
        (ExceptionGroup("start", [ConfigError("--port", 0, "bad")]), "tether x: --port=0: bad\n"),
        # A trainer rank refused the input: its message and where, not its traceback.
        (
            ExceptionGroup(
                "run",
                [
                    RemoteError(
                        "tether.runtime.errors.ConfigError",
                        "--hf-checkpoint='/m': has no config.json",
                        "Traceback (most recent call last):\n  ...\n",
                        actor="trainer-rank0",
                        method="init",
                    )
                ],
            ),
            "tether x: --hf-checkpoint='/m': has no config.json (on trainer-rank0)\n",
        ),
    ],
)
def test_a_user_error_is_one_line_and_status_2(
    exc: BaseException, line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert exit_on_user_error("tether x", lambda: fails(exc)) == 2
    assert capsys.readouterr().err == line


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("a bug"),
        KeyError("k"),
        FileNotFoundError("no filename: where is unknown"),
        RemoteError("builtins.RuntimeError", "a bug on a rank", "Traceback ...", actor="trainer-rank0"),
        ExceptionGroup("start", [ConfigError("--port", 0, "bad"), RuntimeError("a bug")]),
    ],
)
def test_anything_else_keeps_its_traceback(exc: BaseException, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(type(exc)):
        exit_on_user_error("tether x", lambda: fails(exc))


def test_debug_re_raises_user_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError):
        exit_on_user_error("tether x", lambda: fails(ConfigError("--port", 0, "bad")))
    monkeypatch.setenv(DEBUG_ENV, "0")  # "0" is off, as unset
    assert exit_on_user_error("tether x", lambda: fails(ConfigError("--port", 0, "bad"))) == 2


def test_a_command_status_passes_through() -> None:
    assert exit_on_user_error("tether x", lambda: 3) == 3
