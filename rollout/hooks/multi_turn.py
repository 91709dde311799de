"""Multi-turn trajectories: model tokens and tool observations appended to one Sample with their provenance.

Model tokens train (loss_mask 1) and keep the log-probs the engine sampled them with; tool
observations and other inserted text are context only (loss_mask 0, log-prob 0). Every run of
tokens is recorded in `metadata["provenance"]` as `[source, length]`, so a reader can tell which
response positions came from the model and which from the environment, without re-tokenizing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.rollout.engine_api.client import GenerateResponse
from tether.rollout.rollout_fn import RolloutContext
from tether.rollout.sample import Sample

PROVENANCE_KEY = "provenance"
MODEL = "model"
TOOL = "tool"


def _record(sample: Sample, source: str, length: int) -> None:
    runs: list[list[Any]] = sample.metadata.setdefault(PROVENANCE_KEY, [])
    runs.append([source, length])


def append_model_tokens(
    sample: Sample, tokens: Sequence[int], log_probs: Sequence[float], text: str, weight_version: str | None
) -> None:
    """Append sampled tokens: they train, with the log-probs they were sampled with."""
    if len(tokens) != len(log_probs):
        raise ValueError(f"{len(tokens)} model tokens but {len(log_probs)} log-probs")
    if not tokens:
        return
    sample.extend_response(tokens, text, log_probs=log_probs)
    version = weight_version if weight_version is not None else ""
    if not sample.weight_versions or sample.weight_versions[-1] != version:
        sample.weight_versions.append(version)
    _record(sample, MODEL, len(tokens))


def append_observation(sample: Sample, tokens: Sequence[int], text: str, source: str = TOOL) -> None:
    """Append environment tokens (tool output, template glue): context only, never trained on."""
    if not tokens:
        return
    sample.extend_response(tokens, text)
    _record(sample, source, len(tokens))


def provenance_positions(sample: Sample, source: str) -> list[int]:
    """Response positions (0-based within the response) whose tokens came from `source`."""
    out: list[int] = []
    pos = 0
    for src, length in sample.metadata.get(PROVENANCE_KEY, []):
        if src == source:
            out.extend(range(pos, pos + length))
        pos += length
    return out


async def generate_turn(
    ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
) -> GenerateResponse:
    """One model turn on the whole trajectory so far, routed by the sample's session id."""
    _, resp = await ctx.router.generate(sample.tokens, sampling_params, routing_key=sample.session_id)
    return resp
