"""Helpers for tests that drive engines over HTTP: start a CPU engine, a tiny JSON client, and
transformers references for greedy tokens and log-probs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Engine:
    """A running engine: base URL, model directory, process (None for external engines)."""

    url: str
    model_path: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def request(
        self, path: str, payload: Any = None, method: str = "POST", timeout: float = 60
    ) -> tuple[int, Any]:
        data = (
            None
            if payload is None
            else (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
        )
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def post(self, path: str, payload: Any = None, timeout: float = 60) -> Any:
        status, body = self.request(path, payload if payload is not None else {}, timeout=timeout)
        assert status == 200, f"{path} -> {status}: {body}"
        return body

    def get(self, path: str) -> Any:
        status, body = self.request(path, method="GET")
        assert status == 200, f"{path} -> {status}: {body}"
        return body

    def stream(self, payload: dict[str, Any], timeout: float = 60) -> list[Any]:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(payload).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        events: list[Any] = []
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                line = line.strip()
                if line.startswith(b"data: "):
                    body = line[len(b"data: ") :]
                    events.append("[DONE]" if body == b"[DONE]" else json.loads(body))
        return events


def start_cpu_engine(model_path: str, log_dir: Path, *extra: str, deadline_s: float = 60) -> Engine:
    port = free_port()
    log = log_dir / f"engine-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "tether.rollout.cpu_engine",
        "--model-path",
        model_path,
        "--port",
        str(port),
        *extra,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    engine = Engine(url=f"http://127.0.0.1:{port}", model_path=model_path, proc=proc, log=log)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if engine.request("/health", method="GET", timeout=2)[0] == 200:
                return engine
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # polling with a deadline, not standing in for synchronisation
    stop_engine(engine)
    raise RuntimeError(f"engine not ready in {deadline_s}s:\n{log.read_text()[-3000:]}")


def stop_engine(engine: Engine) -> None:
    proc = engine.proc
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def wait_until(predicate: Any, deadline_s: float = 30, what: str = "condition") -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@cache
def _hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of `prompt` by transformers (no EOS stop) and each token's log-prob."""
    model = _hf_model(model_dir)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
        full = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = ids[len(prompt) :]
    lps = [float(full[len(prompt) - 1 + j, tok]) for j, tok in enumerate(out)]
    return out, lps


def make_models(root: Path) -> tuple[str, str]:
    """Two tiny Llama checkpoints with the same shapes and different weights (v1, v2)."""
    from tether.rollout.tiny_model import TinyModelSpec, write_tiny_model

    v1 = write_tiny_model(root / "v1", TinyModelSpec(seed=0))
    v2 = write_tiny_model(root / "v2", TinyModelSpec(seed=1))
    return os.fspath(v1), os.fspath(v2)
