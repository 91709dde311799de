"""tether's agent entry: `--custom-generate-function-path tether.rollout.agents.generate`.

Each sample runs the agent program (--agent-function-path or --agent-command) against a session
of one adapter the rollout serves on 127.0.0.1 (slime.agent's OpenAI or Anthropic adapter,
--agent-api), over the router. When the agent ends, the run's reward hook (--custom-rm-path or
--rm-type) scores the sample with the agent's output as its response, and the session's
trajectory becomes the samples that train: the engine's generated tokens under mask 1, prompts,
template and tool results under 0, one sample per branch (a rewritten history forks), each with
that reward. An agent that made no turn, or failed, leaves its sample in the batch untrained, with
reward 0 (slime's `remove_sample`), and its error in the metadata.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from tether.rollout.agents.program import (
    AgentCallable,
    AgentResult,
    AgentRun,
    run_callable,
    run_command,
)
from tether.rollout.config import AGENT_ENTRY
from tether.rollout.hooks.loader import load_function
from tether.rollout.rollout_fn import RolloutContext, current_context
from tether.rollout.sample import Sample, SampleStatus
from tether.rollout.slime_api.agent.adapters import AnthropicAdapter, OpenAIAdapter
from tether.rollout.slime_api.agent.adapters.common import BaseAdapter
from tether.rollout.slime_api.convert import from_slime, to_slime

logger = logging.getLogger(__name__)

_SERVICE = "tether.rollout.agents.service"
"""RolloutContext.extensions key of the context's AgentService."""
MODEL_LABEL = "tether-policy"
DEFAULT_TIME_BUDGET_SEC = 1800


@dataclass
class AgentService:
    """One adapter per rollout context, served on 127.0.0.1 until the context closes."""

    adapter: BaseAdapter
    base_url: str
    program: AgentCallable | None
    command: str | None


async def _service(ctx: RolloutContext) -> AgentService:
    service: AgentService | None = ctx.extensions.get(_SERVICE)
    if service is not None:
        return service
    cfg = ctx.rollout
    if ctx.tokenizer is None:
        raise RuntimeError(f"{AGENT_ENTRY} needs the model's tokenizer (--hf-checkpoint)")
    args = ctx.args
    adapter_cls = AnthropicAdapter if cfg.agent_api == "anthropic" else OpenAIAdapter  # default openai
    adapter = adapter_cls(
        tokenizer=ctx.tokenizer,
        sglang_url=f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        tool_parser=getattr(args, "sglang_tool_call_parser", None) or None,
        reasoning_parser=getattr(args, "sglang_reasoning_parser", None) or None,
        max_turns_per_sid=cfg.agent_max_turns,
        require_open_sessions=True,  # a key that names no open session is refused (401)
    )
    runner = web.AppRunner(adapter.app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    ctx.resources.push_async_callback(runner.cleanup)
    port = runner.addresses[0][1]
    program = (
        load_function(cfg.agent_function_path, "--agent-function-path") if cfg.agent_function_path else None
    )
    service = AgentService(adapter, f"http://127.0.0.1:{port}", program, cfg.agent_command)
    ctx.extensions[_SERVICE] = service
    logger.info("agent entry: %s adapter at %s", adapter_cls.__name__, service.base_url)
    return service


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
    """Run the agent on `sample`; the samples its session trained (see the module doc)."""
    ctx = current_context()
    service = await _service(ctx)
    cfg = ctx.rollout
    sample = from_slime(sample)
    sid = f"agent-{secrets.token_urlsafe(24)}"  # the agent's only credential: unguessable
    service.adapter.open_session(
        sid, sampling_defaults=sampling_params, max_context_tokens=cfg.rollout_max_context_len or 0
    )
    try:
        run = AgentRun(
            base_url=service.base_url,
            api_key=sid,
            model=MODEL_LABEL,
            prompt=sample.prompt if isinstance(sample.prompt, (str, list)) else str(sample.prompt),
            label=sample.label,
            metadata=dict(sample.metadata),
        )
        result = await _run_agent(service, run, cfg.agent_time_budget_sec or DEFAULT_TIME_BUDGET_SEC)
        probe = msgspec.structs.replace(sample, response=result.output, metadata=dict(sample.metadata))
        reward = await ctx.reward_model.reward_of(probe) if result.error is None else 0.0
        outcome = {"agent_output": result.output, "agent_exit_code": result.exit_code}
        if result.error is not None:
            outcome["agent_error"] = result.error
        produced = await service.adapter.finish_session(
            sid, base_sample=to_slime(sample), reward=reward, extra_metadata=outcome
        )
    finally:
        await service.adapter.drop_session(sid)
    if result.error is not None or not produced:
        why = result.error or "the agent made no turn"
        logger.warning("agent entry: sample %s: %s", sample.index, why)
        return [_untrained(sample, ctx.tokenizer, {**outcome, "agent_error": why})]
    return [from_slime(s) for s in produced]


def _untrained(sample: Sample, tokenizer: Any, outcome: dict[str, Any]) -> Sample:
    """A failed agent run as slime's coding-agent example leaves it (`remove_sample`): in the
    batch with reward 0 and one end-of-sequence token that does not train, so a broken agent costs
    its sample, never a retry loop or the rollout."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return msgspec.structs.replace(
        sample,
        tokens=[*sample.tokens, eos],
        response="",
        response_length=1,
        loss_mask=[0],
        rollout_log_probs=[0.0],
        reward=0.0,
        status=SampleStatus.COMPLETED,
        metadata={**sample.metadata, **outcome},
    )


async def _run_agent(service: AgentService, run: AgentRun, budget: float) -> AgentResult:
    if service.program is not None:
        return await run_callable(service.program, run, time_budget_sec=budget)
    assert service.command is not None
    return await run_command(service.command, run, time_budget_sec=budget)
