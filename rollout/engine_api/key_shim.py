"""Start SGLang's server or the sglang-router with the engine key, keeping it off the command line.

    python key_shim.py MODULE FLAG[,FLAG...] [MODULE'S ARGS...]

Run by the SGLang venv's python as a file (it needs only the standard library: tether is not
installed there). SGLang takes `--api-key`/`--admin-api-key` only as arguments, and a process's
command line is visible to every user of the machine (`ps`). This program takes the key from
TETHER_ENGINE_API_KEY, removes it from its environment (SGLang's own children do not inherit
it), puts `FLAG=key` for each FLAG into its own `sys.argv` (the command line the kernel shows
stays the one it was started with), and runs MODULE as `python -m MODULE` would. SGLang logs its
server arguments at start; every log record that would carry the key carries `<redacted>`.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any

KEY_ENV = "TETHER_ENGINE_API_KEY"  # tether.rollout.engine_api.auth.ENGINE_KEY_ENV
REDACTED = "<redacted>"


def redact_logs(key: str) -> None:
    """Every log record created from now on has `key` replaced in its message."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # a malformed record stays as it is; logging reports it itself
            return record
        if key in text:
            record.msg, record.args = text.replace(key, REDACTED), None
        return record

    logging.setLogRecordFactory(factory)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(f"usage: {argv[0]} MODULE FLAG[,FLAG...] [ARGS...]")
    module, flags, rest = argv[1], [f for f in argv[2].split(",") if f], argv[3:]
    # Run as a file, this directory leads sys.path; its tether modules (sglang_router.py among
    # them) would shadow the packages the module imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    key = os.environ.pop(KEY_ENV, "")
    key_args: list[str] = []
    if key:
        redact_logs(key)
        # `FLAG=key`, one argument: a key that starts with "-" (token_urlsafe makes them) is not
        # taken for a flag by argparse.
        key_args = [f"{flag}={key}" for flag in flags]
    sys.argv = [module, *key_args, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
