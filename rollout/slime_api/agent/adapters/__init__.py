"""`slime.agent.adapters`: HTTP servers speaking the Anthropic and OpenAI wires over the engine,
recording each agent session's exact tokens (common.py: the shared pipeline; anthropic.py,
openai.py: the wires). May import tether.rollout.engine_api, tether.rollout.openai_turns and the
rest of tether.rollout.slime_api.agent."""

from tether.rollout.slime_api.agent.adapters.anthropic import AnthropicAdapter
from tether.rollout.slime_api.agent.adapters.common import BaseAdapter
from tether.rollout.slime_api.agent.adapters.openai import OpenAIAdapter

__all__ = ["AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
