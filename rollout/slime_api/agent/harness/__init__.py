"""`slime.agent.harness`: coding agents run in a sandbox (Claude Code, Codex), behind one lifecycle.

common.py owns the lifecycle (`BaseHarness`: agent user, config, launch and wait), its context
(`HarnessContext`) and the shared steps (`run_agent`, `install_npm_cli`, `install_node22`);
claude_code.py and codex.py each own one CLI's install, config files, command line and
environment. A harness knows nothing of the task: the caller prepares the workspace and passes
the prompt.
"""

from __future__ import annotations

from tether.rollout.slime_api.agent.harness.claude_code import ClaudeCodeHarness
from tether.rollout.slime_api.agent.harness.codex import CodexHarness
from tether.rollout.slime_api.agent.harness.common import BaseHarness, HarnessContext

__all__ = ["BaseHarness", "ClaudeCodeHarness", "CodexHarness", "HarnessContext"]
