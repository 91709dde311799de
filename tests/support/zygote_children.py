"""`python -m support.zygote_children MODE [ARGS]`: small commands the zygote tests start, both
forked from the zygote and spawned, to compare the two (no tests in this module).

MODE is one of:
  describe CODE   print what the process sees (argv, cwd, sys.path, environment, ids) as JSON, exit CODE
  raise           raise an uncaught exception (exit code 1, traceback in the log)
  interrupt       raise an uncaught KeyboardInterrupt (the interpreter then dies by SIGINT)
  kill SIG        send itself signal SIG
  stubborn        ignore SIGTERM, say "stubborn ready", sleep (stopped only by SIGKILL)
  polite          exit 0 on SIGTERM, say "polite ready", sleep
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from pathlib import Path


def describe() -> dict[str, object]:
    return {
        "argv": sys.argv,
        # what ps shows: the command, whether spawned or forked from the zygote (proc_title.show_as)
        "cmdline": [a for a in Path("/proc/self/cmdline").read_bytes().decode().split("\0") if a],
        "cwd": os.getcwd(),
        "path": sys.path,
        "main": __name__,
        "env": {
            k: os.environ.get(k) for k in ("ZYGOTE_TEST", "TETHER_PROCESS_NAME", "PYTHONPATH", "DROPPED")
        },
        "secret": bool(os.environ.get("TETHER_SECRET")),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "stdin": os.readlink("/proc/self/fd/0"),
        "stdout": os.readlink("/proc/self/fd/1"),
        "stderr": os.readlink("/proc/self/fd/2"),
        "sigint": repr(signal.getsignal(signal.SIGINT)),
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "sigchld": repr(signal.getsignal(signal.SIGCHLD)),
        "sigpipe": repr(signal.getsignal(signal.SIGPIPE)),
        "unbuffered": sys.stdout.write_through,
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),  # the zygote's preloaded modules, frozen before forks
    }


def _sleep_forever(word: str) -> None:
    print(f"{word} ready", flush=True)
    while True:
        time.sleep(60)


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "describe":
        print(json.dumps(describe()))
        return int(argv[1])
    if mode == "raise":
        raise RuntimeError("raised on purpose")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "kill":
        os.kill(os.getpid(), int(argv[1]))
        time.sleep(10)
        return 99
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _sleep_forever("stubborn")
    if mode == "polite":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        _sleep_forever("polite")
    print(f"unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
