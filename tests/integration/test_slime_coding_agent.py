"""slime's coding-agent example (examples/coding_agent_rl/generate.py and swe.py, read from
slime's source and imported unchanged) runs one sample end to end on this machine: tether's
LocalSandbox under SLIME_AGENT_SANDBOX_BACKEND=local stands in for E2B, a scripted `claude` CLI
(tests/support/agents/fake_claude, installed from npm tarballs the way ClaudeCodeHarness installs
Claude Code) talks to the example's Anthropic adapter, which talks to a real CPU engine; the model
is made to call the CLI's `write_file` tool, the CLI writes the fix in the sandbox, the example
takes the `git diff`, grades it with the row's `eval_cmd` in a fresh sandbox, and returns the
session's Samples with that reward.

Needs root and bwrap (LocalSandbox), node and npm, and slime's source; skips and says so otherwise.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.engines import ENGINE_KEY, start_cpu_engine, stop_engine
from support.net import free_port
from support.slime_source import slime_file
from transformers import AutoTokenizer

from tether.rollout.slime_api import finder
from tether.rollout.slime_api.agent.local_sandbox import LocalSandboxUnavailable, check_host

FAKE_CLAUDE = Path(__file__).resolve().parents[1] / "support" / "agents" / "fake_claude"
BUGGY = "def add(a, b):\n    return a - b\n"


def _why_not() -> str | None:
    try:
        check_host()
    except LocalSandboxUnavailable as e:
        return f"LocalSandbox cannot run here: {e}"
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node and npm are not installed"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def _tarball(dest: Path, files: dict[str, tuple[bytes, int]]) -> Path:
    """A gzipped tar of `files` (name → (content, mode))."""
    with tarfile.open(dest, "w:gz") as tar:
        for name, (content, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(content), mode
            tar.addfile(info, io.BytesIO(content))
    return dest


def _host_node_tarball(dest: Path) -> Path:
    """A "Node 22" tarball whose node, npm and npx run the host's (the sandbox sees the host's /usr)."""
    wrapper = {
        tool: (f'#!/bin/sh\nexec {shutil.which(tool)} "$@"\n'.encode(), 0o755)
        for tool in ("node", "npm", "npx")
    }
    return _tarball(dest, {f"node-v22-host/bin/{tool}": body for tool, body in wrapper.items()})


def _cli_tarball(dest: Path) -> Path:
    """The scripted CLI as `npm pack` lays a package out."""
    return _tarball(
        dest,
        {
            "package/package.json": ((FAKE_CLAUDE / "package.json").read_bytes(), 0o644),
            "package/cli.py": ((FAKE_CLAUDE / "cli.py").read_bytes(), 0o755),
        },
    )


def _image(root: Path, workdir: str) -> Path:
    """The task's "image": a host directory seeding the sandbox with a git repo holding the bug."""
    repo = root / workdir.lstrip("/")
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text(BUGGY)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "calc.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "the bug"], check=True)
    return root


def test_slimes_coding_agent_generate_runs_one_sample_with_the_local_sandbox(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "slime_examples" / "examples"
    (package / "coding_agent_rl").mkdir(parents=True)
    for name in (
        "examples/__init__.py",
        "examples/coding_agent_rl/generate.py",
        "examples/coding_agent_rl/swe.py",
    ):
        slime_file(name, package.parent / name)
    (package / "coding_agent_rl" / "__init__.py").write_text("")  # a namespace package in slime

    workdir = "/testbed" if not Path("/testbed").exists() else "/tether-testbed"
    image = _image(tmp_path / "image", workdir)
    for name, value in {
        "SLIME_AGENT_SANDBOX_BACKEND": "local",
        "TETHER_AGENT_SANDBOX_DIR": str(tmp_path / "sandboxes"),
        "SLIME_AGENT_NODE_TARBALL": str(_host_node_tarball(tmp_path / "node22.tar.gz")),
        "SLIME_AGENT_CC_TARBALL": str(_cli_tarball(tmp_path / "claude.tgz")),
        "SWE_AGENT": "claude_code",
        "ADAPTER_PUBLIC_HOST": "127.0.0.1",
        "ADAPTER_BIND_HOST": "127.0.0.1",
        "ADAPTER_PORT": str(free_port()),
        "SWE_AGENT_TIME_BUDGET_SEC": "300",
        "SWE_EVAL_TIMEOUT_SEC": "120",
        "TETHER_ENGINE_API_KEY": ENGINE_KEY,  # the adapter's upstream key; the sandbox never sees it
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.syspath_prepend(str(package.parent))
    finder.install()

    engine = start_cpu_engine(tiny_model, tmp_path)
    try:
        generate_mod = importlib.import_module("examples.coding_agent_rl.generate")
        from slime.utils.types import Sample

        host, port = engine.url.removeprefix("http://").rsplit(":", 1)
        args = SimpleNamespace(
            hf_checkpoint=str(tiny_model),
            rollout_max_context_len=0,
            sglang_tool_call_parser="qwen25",
            sglang_reasoning_parser=None,
            sglang_router_ip=host,
            sglang_router_port=int(port),
        )
        sample = Sample(
            index=0,
            group_index=0,
            prompt="calc.add subtracts",
            label="calc-1",
            metadata={
                "instance_id": "calc-1",
                "image": str(image),
                "workdir": workdir,
                "problem_statement": "calc.add(a, b) returns a - b; it must return a + b.",
                "eval_cmd": "python3 -c 'import calc; assert calc.add(2, 3) == 5'",
            },
        )
        samples = asyncio.run(
            generate_mod.generate(args, sample, {"temperature": 1.0, "max_new_tokens": 512})
        )
    finally:
        sys.modules.pop("examples.coding_agent_rl.generate", None)
        stop_engine(engine)

    assert len(samples) == 1, [s.metadata for s in samples]
    (out,) = samples
    assert "abort_reason" not in out.metadata, out.metadata
    # the fix the model wrote through the CLI's tool call was graded in a fresh sandbox: solved
    assert out.reward == 1.0 and out.metadata["grading_solved"] is True
    assert out.metadata["agent_exit_code"] == 0 and out.metadata["instance_id"] == "calc-1"
    assert out.metadata["use_tool"] and out.session_id.startswith("cagent-calc-1-")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    response = out.tokens[len(out.tokens) - out.response_length :]
    trained = tokenizer.decode([t for t, m in zip(response, out.loss_mask, strict=True) if m])
    untrained = tokenizer.decode([t for t, m in zip(response, out.loss_mask, strict=True) if not m])
    assert json.dumps("def add(a, b):\n    return a + b\n")[1:-1] in trained  # the model's call, trained
    assert "TOOL-RESULT written" in untrained and "TOOL-RESULT" not in trained  # the tool's, not
    assert list((tmp_path / "sandboxes").iterdir()) == []  # both sandboxes gone
