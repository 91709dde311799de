"""Agent programs the agent tests run (each also loadable by path), and a sample `AgentRun`."""

from __future__ import annotations

from tether.rollout.agents import AgentRun

SAMPLE_RUN = AgentRun(
    base_url="http://127.0.0.1:9",
    api_key="agent-key",
    model="tether-policy",
    prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
    label="4",
    metadata={"task": "arith"},
)
"""A run as the entry hands one over (the adapter at port 9: nothing listens there)."""
