"""What both route tables of the CPU engine's HTTP server share (the native endpoints in
http_api.py, the OpenAI ones in openai_api.py): the engine's state and limits, refusals in
SGLang's error shape, and request bodies read under the size limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tether.rollout.cpu_engine.scheduler import Scheduler
from tether.rollout.cpu_engine.weights.receive import BucketReceiver
from tether.runtime.weight_group import WeightGroup

HEALTH_TIMEOUT_S = 20.0  # SGLang's default (SGLANG_HEALTH_CHECK_TIMEOUT)


class EngineLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine accepts; each refusal names the flag that sets the limit."""

    max_request_bytes: int = 16 << 20
    """--max-request-bytes: largest request body (413 above)."""
    max_prompts_per_request: int = 512
    """--max-prompts-per-request: prompts one /generate may carry (400 above)."""
    health_timeout: float = HEALTH_TIMEOUT_S
    """--health-check-timeout: how long /health_generate waits for the scheduler to step."""
    group_setup_timeout: float = 60.0
    """--weight-group-setup-timeout: seconds /init_weights_update_group may wait for its peers."""
    max_group_setups: int = 2
    """--max-weight-group-setups: weight-group joins in progress at once (503 beyond)."""
    allow_nonfinite_weights: bool = False
    """--allow-nonfinite-weights: accept weight updates holding NaN or inf."""


class BadRequest(Exception):
    """A refused request: SGLang's error body with `status` (400 unless a subclass says)."""

    status = 400


class TooLarge(BadRequest):
    status = 413


class Busy(BadRequest):
    status = 503


MAX_BODY = web.AppKey("max_request_bytes", int)


async def read_body(request: web.Request, kind: type[Any], allow_empty: bool = False) -> Any:
    limit = request.app[MAX_BODY]
    too_large = TooLarge(
        f"{request.path}: the request body ({request.content_length or 'more than ' + str(limit)} bytes) "
        f"exceeds this engine's limit of {limit} bytes (--max-request-bytes)"
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large  # refused before a byte of it is read
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    if not raw.strip():
        if allow_empty:
            raw = b"{}"
        else:
            raise BadRequest(f"{request.path}: the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{request.path}: invalid field: {e}") from e
    except msgspec.DecodeError as e:
        raise BadRequest(f"{request.path}: malformed JSON: {e}") from e


@dataclass
class EngineState:
    scheduler: Scheduler
    model_path: str
    host: str
    port: int
    delay: Callable[[], float] = field(default=lambda: 0.0)
    """Seconds a request waits before it joins the batch (benchmarks imitate slow engines)."""
    disk_path: str = ""
    disk_version: str = ""
    groups: dict[str, WeightGroup] = field(default_factory=dict)
    used_group_names: set[str] = field(default_factory=set)
    session_open: bool = False
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    receiver: BucketReceiver = field(default_factory=BucketReceiver)
    receiving: int = 0  # weight broadcasts being received now (a blocked one cannot be interrupted)
    group_setups: int = 0  # weight-group joins whose thread has not returned (nor can be stopped)
    api_key: str | None = None
    """The key every endpoint but /health requires; None serves without authentication."""
    limits: EngineLimits = field(default_factory=EngineLimits)
    on_fatal: Callable[[BaseException], None] | None = None
    """Called once if the scheduler task fails: the process must end (cpu_engine exits non-zero)."""
    served_model_name: str | None = None
    """The model's name in /v1/models (--served-model-name; default: the model path)."""
    tool_call_parser: str | None = None
    """--tool-call-parser: the tool-call format /v1/chat/completions parses and constrains."""
    cuda_graph_released: bool = False
    """The cuda_graph memory tag was released (the engine captures no graphs: bookkeeping only)."""


__all__ = ["BadRequest", "Busy", "EngineLimits", "EngineState", "TooLarge", "read_body"]
