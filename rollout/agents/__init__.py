"""tether's agent entry: any agent program that speaks the OpenAI or Anthropic API, trained
token-exactly (`--custom-generate-function-path tether.rollout.agents.generate`; docs/agents.md).

program.py: what an agent run is given and how a callable or a command is run; entry.py: the
per-sample generate over slime.agent's adapters. May import tether.rollout (its slime_api.agent
included) and tether.runtime.
"""

from tether.rollout.agents.entry import generate
from tether.rollout.agents.program import AgentResult, AgentRun

__all__ = ["AgentResult", "AgentRun", "generate"]
