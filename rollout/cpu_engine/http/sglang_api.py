"""The CPU engine's HTTP surface: SGLang's native API over aiohttp.

Request and response shapes follow SGLang 0.5.23 (`/generate`, health and info endpoints,
abort/pause/continue, the weight-update family, memory release; the OpenAI-compatible `/v1/*`
endpoints live in openai_api.py). Errors come back as SGLang
sends them: `/generate` and validation errors answer 400 with `{"error": {"message": ...}}`
(plus SGLang's flat `object/message/type/code` fields); the weight endpoints answer
`{"success": false, "message": ...}` with 400. A bad request never stops the server.

Nobody who can reach the port steers the engine: every endpoint but `GET /health` requires the
engine key as `Authorization: Bearer <key>` (401 otherwise, before the body is read, changing
nothing). Inputs are bounded, each refusal a 4xx naming its limit: the body size
(--max-request-bytes, 413), the prompts of one request (--max-prompts-per-request), and text is
tokenized on a thread, not on the event loop. Joining a weight group runs on threads of its own
(at most --max-weight-group-setups at once, 503 beyond) and gives up after
--weight-group-setup-timeout, so an address that never answers cannot hold threads the
forward pass or other requests need. Weight updates holding NaN or inf are refused with 400
naming the tensor (unless --allow-nonfinite-weights).
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import msgspec
import torch
from aiohttp import web

from tether.rollout.cpu_engine.constrained import GrammarConstraint, schema_node
from tether.rollout.cpu_engine.http.common import (
    MAX_BODY,
    BadRequest,
    Busy,
    EngineState,
    read_body,
)
from tether.rollout.cpu_engine.http.openai_api import OpenAIRoutes
from tether.rollout.cpu_engine.http.sse import send_events
from tether.rollout.cpu_engine.modeling.model import (
    ModelConfig,
    ModelConfigError,
    WeightMismatch,
    check_finite,
    read_safetensors_dir,
)
from tether.rollout.cpu_engine.prompt_logprobs import check_start, wants_scoring
from tether.rollout.cpu_engine.sampling import SamplingParams, parse_sampling_params
from tether.rollout.cpu_engine.scheduler import EngineUnavailable, Request, Scheduler, progress
from tether.rollout.cpu_engine.weights.checker import CheckWeightsReq, WeightsChecker, WeightsCheckFailed
from tether.rollout.cpu_engine.weights.receive_stream import receive_stream
from tether.rollout.engine_api.auth import authorized
from tether.rollout.engine_api.weights import PayloadRejected, decode_named_tensors
from tether.runtime.bucket_stream import STREAM_CAPABILITY, STREAM_ENDPOINT
from tether.runtime.weight_group import WeightGroup, destroy_weight_group, init_weight_group

ENGINE_VERSION = "tether-cpu-engine 0.1 (SGLang 0.5.23 API)"
PUBLIC_PATHS = frozenset({"/health"})  # liveness for probes that hold no key; it reveals nothing


# ----- request bodies (unknown fields are ignored, as SGLang's pydantic models do) -----


class AbortReq(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class PauseReq(msgspec.Struct, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class DiskUpdateReq(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class InitGroupReq(msgspec.Struct, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DistUpdateReq(msgspec.Struct, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DistStreamReq(msgspec.Struct, kw_only=True):
    """tether's streamed update (tether.runtime.bucket_stream): the buckets' names, dtypes and
    shapes arrive over the group, ahead of each bucket's bytes."""

    group_name: str = "weight_update_group"
    flattened: bool = False
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyGroupReq(msgspec.Struct, kw_only=True):
    group_name: str = "weight_update_group"


class TensorUpdateReq(msgspec.Struct, kw_only=True):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class VersionReq(msgspec.Struct, kw_only=True):
    new_version: str
    abort_all_requests: bool = False


class WeightsByNameReq(msgspec.Struct, kw_only=True):
    name: str
    truncate_size: int = 100


class MemoryReq(msgspec.Struct, kw_only=True):
    tags: list[str] | None = None


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's GPU_MEMORY_ALL_TYPES: what `tags` may name; no tags (None or []) means all of them."""


def memory_tags(req: MemoryReq) -> set[str]:
    """The tags a release or resume acts on, as SGLang reads them; 400 for an unknown one."""
    tags = set(req.tags or MEMORY_TAGS)
    unknown = tags - set(MEMORY_TAGS)
    if unknown:
        raise BadRequest(f"tags={sorted(unknown)!r}: unknown memory tags (known: {list(MEMORY_TAGS)})")
    return tags


class GenerateReq(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_text_in_logprobs: bool = False


def error_response(message: str, status: int = 400) -> web.Response:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    body = {
        "error": {"message": message, "type": phrase, "param": None, "code": status},
        "object": "error",
        "message": message,
        "type": phrase,
        "param": None,
        "code": status,
    }
    return web.json_response(body, status=status)


def result_response(success: bool, message: str, **extra: Any) -> web.Response:
    return web.json_response(
        {"success": success, "message": message, **extra}, status=200 if success else 400
    )


def updated_response(message: str, weight_version: str | None, **extra: Any) -> web.Response:
    """A weight update's success, naming the new version when the request set one (as SGLang)."""
    if weight_version is not None:
        message += f" Weight version updated to {weight_version}."
    return result_response(True, message, **extra)


_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "float", "half", "double")
}


def parse_dtype(text: str) -> torch.dtype:
    key = text.removeprefix("torch.")
    if key not in _DTYPES:
        raise BadRequest(f"dtypes: {text!r} is not a supported floating point dtype")
    return _DTYPES[key]


def _texts(req: GenerateReq, max_prompts: int) -> list[str] | None:
    """The request's text prompts (None for input_ids); refuses a request with too many prompts
    before anything is tokenized."""
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("exactly one of text or input_ids must be given")
    n = (1 if isinstance(req.text, str) else len(req.text)) if req.text is not None else None
    if n is None and req.input_ids is not None:
        n = len(req.input_ids) if _is_batched_ids(req.input_ids) else 1
    if n is not None and n > max_prompts:
        raise BadRequest(
            f"the request holds {n} prompts; this engine takes at most {max_prompts} per request "
            "(--max-prompts-per-request)"
        )
    if req.text is None:
        return None
    return [req.text] if isinstance(req.text, str) else req.text


def _normalise(
    req: GenerateReq, sched: Scheduler, encoded: list[list[int]] | None
) -> list[tuple[list[int], SamplingParams, str, bool, int, int]]:
    """Split a single or batched request into (prompt ids, params, rid, return_logprob,
    top_logprobs_num, logprob_start_len) items; `encoded`: the text prompts' token ids (tokenized
    off the event loop)."""
    prompts: list[list[int]]
    if req.text is not None:
        assert encoded is not None
        prompts = encoded
        batched = not isinstance(req.text, str)
    else:
        ids = req.input_ids or []
        batched = bool(ids) and all(isinstance(x, list) for x in ids)
        prompts = ids if batched else [ids]  # type: ignore[assignment]
        for i, p in enumerate(prompts):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise BadRequest(
                    f"input_ids[{i}]: must be a list of integers"
                    if batched
                    else "input_ids: must be a list of integers"
                )
    n = len(prompts)
    if n == 0:
        raise BadRequest("the request holds no prompt")

    def per_item(value: Any, name: str) -> list[Any]:
        if isinstance(value, list):
            if len(value) != n:
                raise BadRequest(f"{name}: has {len(value)} entries for {n} prompts")
            return value
        return [value] * n

    sps = [parse_sampling_params(sp) for sp in per_item(req.sampling_params, "sampling_params")]
    lps = [bool(x) for x in per_item(req.return_logprob, "return_logprob")]
    starts = [-1 if v is None else v for v in per_item(req.logprob_start_len, "logprob_start_len")]
    for i, (prompt, start) in enumerate(zip(prompts, starts, strict=True)):
        where = f"logprob_start_len[{i}]" if isinstance(req.logprob_start_len, list) else "logprob_start_len"
        why = check_start(start, len(prompt), where)
        if why is not None and lps[i]:  # as SGLang, ignored without return_logprob
            raise BadRequest(why)
    starts = [s if lp else -1 for s, lp in zip(starts, lps, strict=True)]
    tops = [v or 0 for v in per_item(req.top_logprobs_num, "top_logprobs_num")]
    if any(v < 0 for v in tops):
        raise BadRequest(f"top_logprobs_num={req.top_logprobs_num!r}: must be >= 0")
    if req.rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(req.rid, str):
        rids = [req.rid] if n == 1 and not batched else [f"{req.rid}_{i}" for i in range(n)]
    else:
        rids = per_item(req.rid, "rid")
    if req.return_routed_experts and not sched.return_routed_experts:
        raise BadRequest(
            "return_routed_experts: this engine does not record routed experts "
            "(start it with --enable-return-routed-experts)"
        )
    ctx, vocab = sched.context_length, sched.cfg.vocab
    for i, (prompt, sp) in enumerate(zip(prompts, sps, strict=True)):
        if not prompt:
            raise BadRequest(f"prompt {i} is empty")
        if req.return_routed_experts and sp.max_new_tokens == 0:
            # Such a prompt finishes without a forward, so there is nothing routed to report.
            raise BadRequest(
                f"return_routed_experts with sampling_params[{i}].max_new_tokens=0 is not supported "
                "by the CPU engine (ask for at least one token)"
            )
        if req.return_routed_experts and not 0 <= req.routed_experts_start_len <= len(prompt):
            raise BadRequest(
                f"routed_experts_start_len={req.routed_experts_start_len}: must be in [0, {len(prompt)}] "
                f"(the prompt's {len(prompt)} tokens)"
            )
        if len(prompt) >= ctx:  # first: it is O(1), and a huge prompt is refused without a scan
            raise BadRequest(
                f"The input ({len(prompt)} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) + sp.max_new_tokens > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {len(prompt) + sp.max_new_tokens} tokens: {len(prompt)} tokens from "
                f"the input messages and {sp.max_new_tokens} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit."
            )
    return list(zip(prompts, sps, rids, lps, tops, starts, strict=True))


class EngineApp:
    """Handlers bound to one engine's state."""

    def __init__(self, state: EngineState) -> None:
        self.s = state
        limits = state.limits
        # Blocking work beside the forward pass (which has its own thread, see engine_scheduler):
        # joining and leaving weight groups and receiving buckets on threads no request can
        # exhaust; tokenizing on two of its own, so a huge text delays only other texts.
        self._setup_lock = threading.Lock()  # guards state.group_setups (a stuck join keeps its slot)
        self._group_threads = ThreadPoolExecutor(
            max_workers=limits.max_group_setups + 2, thread_name_prefix="engine-weight-group"
        )
        self._tokenize_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="engine-tokenize")
        self._weights_checker = WeightsChecker()  # SGLang's /weights_checker snapshot
        self.openai = OpenAIRoutes(self)

    @property
    def sched(self) -> Scheduler:
        return self.s.scheduler

    @property
    def tokenize_threads(self) -> ThreadPoolExecutor:
        """Threads for tokenizing and chat templates (never the event loop)."""
        return self._tokenize_threads

    async def _on_group_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._group_threads, functools.partial(fn, *args))

    def build(self) -> web.Application:
        app = web.Application(
            middlewares=[self._auth, self._errors], client_max_size=self.s.limits.max_request_bytes
        )
        app[MAX_BODY] = self.s.limits.max_request_bytes
        app.cleanup_ctx.append(self._scheduler_ctx)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/begin_weight_update", self.begin_update)
        r.add_post("/end_weight_update", self.end_update)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post(STREAM_ENDPOINT, self.update_from_distributed_stream)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/get_weights_by_name", self.weights_by_name)
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        r.add_route("*", "/weights_checker", self.weights_checker)
        self.openai.add_to(r)
        return app

    async def _scheduler_ctx(self, app: web.Application) -> AsyncIterator[None]:
        # The app owns the scheduler task: it starts with the server and is awaited on cleanup.
        task = asyncio.get_running_loop().create_task(self.sched.run(), name="engine-scheduler")
        task.add_done_callback(self._scheduler_ended)
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # a failure was reported when it happened
        for group in self.s.groups.values():
            await self._on_group_thread(destroy_weight_group, group)
        self.sched.close()
        self._group_threads.shutdown(wait=False, cancel_futures=True)
        self._tokenize_threads.shutdown(wait=False, cancel_futures=True)

    def _scheduler_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            error = RuntimeError("the scheduler loop returned")
        print(f"tether cpu engine: the scheduler failed: {type(error).__name__}: {error}", flush=True)
        traceback.print_exception(error)
        if self.s.on_fatal is not None:
            self.s.on_fatal(error)

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        key = self.s.api_key
        if (
            key is None
            or request.path in PUBLIC_PATHS
            or authorized(request.headers.get("Authorization"), key)
        ):
            return await handler(request)
        # Before the body is read and before any handler runs: an unauthenticated call changes nothing.
        response = error_response(
            f"{request.path}: this engine requires its API key as 'Authorization: Bearer <key>'", status=401
        )
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as e:
            return error_response(str(e), e.status)
        except (ValueError, EngineUnavailable) as e:
            return error_response(str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # a server keeps serving after a fault in one request
            return error_response(f"{type(e).__name__}: {e}", status=500)

    # ----- health and info -----

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.sched.model.loaded else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        timeout = self.s.limits.health_timeout
        if self.sched.failed is not None:
            return web.Response(status=503)
        if self.sched.paused:
            # Generation is paused on purpose (a weight update): the engine is healthy, and a
            # probe queued behind the pause would only time out.
            return web.Response(status=200)
        if self.sched.running:
            # Requests are decoding: healthy only if the model finishes a step within the
            # timeout (a scheduler stuck in an operation or a step must not look alive).
            try:
                async with asyncio.timeout(timeout):
                    await self.sched.next_step()
            except (TimeoutError, EngineUnavailable):
                return web.Response(status=503)
            return web.Response(status=200)
        req = Request(
            rid=f"HEALTH_CHECK_{time.time()}",
            prompt=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            return_logprob=False,
            generator=self.sched.new_generator(0),
        )
        try:
            self.sched.submit(req)
        except EngineUnavailable:
            return web.Response(status=503)
        try:
            async with asyncio.timeout(timeout):
                await req.done.wait()
        except TimeoutError:
            self.sched.abort(req.rid, False)
            return web.Response(status=503)
        # Answered, even aborted (a pause or abort_all takes the probe too): the loop is alive.
        return web.Response(status=200 if self.sched.failed is None else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.s.model_path,
                "tokenizer_path": self.s.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.sched.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.sched.cfg.model_type,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        s = self.sched
        return web.json_response(
            {
                "model_path": self.s.model_path,
                "tokenizer_path": self.s.model_path,
                "host": self.s.host,
                "port": self.s.port,
                "context_length": s.context_length,
                "max_running_requests": s.max_running,
                "weight_version": s.weight_version,
                "device": s.model.device.type,
                "dtype": str(s.model.dtype).removeprefix("torch."),
                # Which of SGLang's memory tags are released now (empty: all resumed).
                "memory_released_tags": self.released_tags(),
                "tp_size": 1,
                "dp_size": 1,
                "version": ENGINE_VERSION,
                # A server argument, reported as SGLang reports its own (what the engine enforces).
                "allow_nonfinite_weights": self.s.limits.allow_nonfinite_weights,
                "internal_states": [
                    {
                        "running": len(s.running),
                        "waiting": len(s.waiting),
                        "paused": s.paused,
                        "weights_loaded": s.model.loaded,
                        "weight_receives": self.s.receiving,
                        "weight_group_setups": self.s.group_setups,
                        "steps": s.steps,
                        "tokens_generated": s.tokens_generated,
                        **self._memory_usage(),
                    }
                ],
            }
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.sched.weight_version})

    def released_tags(self) -> list[str]:
        """The memory tags released now, read from what the engine holds."""
        held = {
            "weights": self.sched.model.loaded,
            "kv_cache": self.sched.cache is not None,
            "cuda_graph": not self.s.cuda_graph_released,
        }
        return [tag for tag in MEMORY_TAGS if not held[tag]]

    def _memory_usage(self) -> dict[str, int | None]:
        """Bytes the weights and the KV cache hold, and on cuda what this process's caching
        allocator has allocated and reserved on the engine's GPU (what a release frees)."""
        device = self.sched.model.device
        cuda = device.type == "cuda"
        return {
            "weight_bytes": self.sched.model.nbytes,
            "kv_cache_bytes": self.sched.cache.nbytes if self.sched.cache is not None else 0,
            "cuda_memory_allocated": torch.cuda.memory_allocated(device) if cuda else None,
            "cuda_memory_reserved": torch.cuda.memory_reserved(device) if cuda else None,
        }

    # ----- generation -----

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body: GenerateReq = await read_body(request, GenerateReq)
        texts = _texts(body, self.s.limits.max_prompts_per_request)
        encoded = None
        if texts is not None:
            # Tokenizing megabytes of text takes seconds: never on the event loop.
            loop = asyncio.get_running_loop()
            encoded = await loop.run_in_executor(self._tokenize_threads, self.encode, texts)
        items = _normalise(body, self.sched, encoded)
        constraints = [await self._json_constraint(sp) for _, sp, *_ in items]
        now = time.monotonic()
        reqs = [
            Request(
                rid=rid,
                prompt=prompt,
                params=sp,
                return_logprob=lp,
                generator=self.sched.new_generator(sp.sampling_seed),
                ready_at=now + self.s.delay(),
                top_logprobs_num=top,
                return_routed_experts=body.return_routed_experts,
                routed_experts_start_len=body.routed_experts_start_len,
                logprob_start_len=start,
                return_text_in_logprobs=body.return_text_in_logprobs,
                constraint=constraint,
            )
            for (prompt, sp, rid, lp, top, start), constraint in zip(items, constraints, strict=True)
        ]
        self.submit_all(reqs)
        single = len(reqs) == 1 and isinstance(body.text, str | None) and not _is_batched_ids(body.input_ids)
        if body.stream:
            return await self._stream(request, reqs, single)
        await self.wait_all(reqs)
        out = [self.sched.response(req) for req in reqs]
        return web.json_response(out[0] if single else out)

    async def _json_constraint(self, sp: SamplingParams) -> GrammarConstraint | None:
        """The grammar of `sampling_params.json_schema` (one JSON document, then the end)."""
        if sp.json_schema is None:
            return None
        try:
            head = schema_node(json.loads(sp.json_schema))
        except (TypeError, ValueError, KeyError) as e:
            raise BadRequest(f"sampling_params.json_schema: {e}") from None
        return GrammarConstraint(head=head, vocab=await self.openai.vocab(), then_free=False)

    def submit_all(self, reqs: list[Request]) -> None:
        """Submit every request (one with max_new_tokens 0 finishes at once); if one is refused,
        those already submitted are aborted and the refusal propagates."""
        submitted: list[Request] = []
        try:
            for req in reqs:
                scores = wants_scoring(req.return_logprob, req.logprob_start_len, len(req.prompt))
                if req.params.max_new_tokens == 0 and not scores:  # a scoring one needs its prefill
                    self.sched.finish_now(req)
                    continue
                self.sched.submit(req)
                submitted.append(req)
        except (ValueError, EngineUnavailable):
            for req in submitted:
                self.sched.abort(req.rid, False)
            raise

    async def wait_all(self, reqs: list[Request]) -> None:
        """Wait until every request has finished; a caller that goes away aborts them."""
        try:
            for req in reqs:
                await req.done.wait()
        except asyncio.CancelledError:
            for req in reqs:
                self.sched.abort(req.rid, False, "client disconnected")
            raise

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Worker thread: the token ids of each text."""
        return [encoding.ids for encoding in self.sched.tokenizer.encode_batch(texts)]

    async def _stream(self, request: web.Request, reqs: list[Request], single: bool) -> web.StreamResponse:
        async def events() -> AsyncIterator[bytes]:
            async for i, req in progress(reqs):
                chunk = self.sched.response(req)
                if not single:
                    chunk["index"] = i
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"

        return await send_events(request, events(), lambda: self._abort_all(reqs))

    def _abort_all(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.sched.abort(req.rid, False, "client disconnected")

    async def abort_request(self, request: web.Request) -> web.Response:
        body: AbortReq = await read_body(request, AbortReq, allow_empty=True)
        self.sched.abort(body.rid or None, body.abort_all)
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body: PauseReq = await read_body(request, PauseReq, allow_empty=True)

        async def op() -> None:
            self.sched.pause(body.mode)

        await self.sched.between_steps(op)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        async def op() -> None:
            self.sched.resume()

        await self.sched.between_steps(op)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to flush; like SGLang, refuse while requests are in flight.
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n",
            status=200 if self.sched.idle else 400,
        )

    # ----- weights -----

    async def _apply(
        self, named: dict[str, torch.Tensor], complete: bool, version: str | None, abort_all: bool
    ) -> None:
        """Swap weights between two steps; a mismatch raises and the old weights keep serving."""

        async def op() -> None:
            if abort_all:
                self.sched.abort(None, True, "Aborted for a weight update")
                self.sched.apply_aborts()
            if not self.sched.model.loaded and not complete:
                raise WeightMismatch("the weights are released; resume memory occupation first")
            self.sched.model.load(named, complete=complete)
            if version is not None:
                self.sched.weight_version = version

        await self.sched.between_steps(op)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body: DiskUpdateReq = await read_body(request, DiskUpdateReq)
        if body.load_format not in (None, "auto", "safetensors"):
            return result_response(
                False, f"load_format={body.load_format!r} is not supported", num_paused_requests=0
            )
        try:
            cfg = await asyncio.to_thread(ModelConfig.from_dir, body.model_path)
            if cfg != self.sched.cfg:
                raise ModelConfigError(
                    f"{body.model_path}: the model config differs from the one being served"
                )
            named = await asyncio.to_thread(self._read_checked, body.model_path)
            async with self.s.update_lock:
                await self._apply(named, True, body.weight_version, body.abort_all_requests)
        except (ModelConfigError, WeightMismatch) as e:
            return result_response(False, f"Failed to update weights: {e}", num_paused_requests=0)
        self.s.disk_path = body.model_path
        self.s.disk_version = self.sched.weight_version
        return updated_response(
            "Succeeded to update model weights.", body.weight_version, num_paused_requests=0
        )

    def _read_checked(self, path: str) -> dict[str, torch.Tensor]:
        """Worker thread: a checkpoint's tensors, refused if any holds NaN or inf (unless allowed)."""
        named = read_safetensors_dir(path)
        if not self.s.limits.allow_nonfinite_weights:
            check_finite(named.items())
        return named

    def _decode_checked(self, payload: str) -> dict[str, torch.Tensor]:
        named = dict(decode_named_tensors(payload, self.sched.model.device))
        if not self.s.limits.allow_nonfinite_weights:
            check_finite(named.items())
        return named

    async def init_group(self, request: web.Request) -> web.Response:
        body: InitGroupReq = await read_body(request, InitGroupReq)
        if body.group_name in self.s.used_group_names:
            return result_response(False, f"group_name={body.group_name!r} was already used on this server")
        # NCCL moves GPU memory only: an engine on the host would get host buffers broadcast
        # through it even where CUDA is visible, so the engine's device decides, not the host.
        device = getattr(self.sched.model, "device", torch.device("cpu"))
        if body.backend == "nccl" and device.type != "cuda":
            return result_response(
                False,
                f"backend={body.backend!r}: NCCL carries GPU memory only and this engine runs on "
                f"{device.type} (--device {device.type}); use backend='gloo'",
            )
        limits = self.s.limits
        with self._setup_lock:
            if self.s.group_setups >= limits.max_group_setups:
                raise Busy(
                    f"{limits.max_group_setups} weight-group setups are in progress already "
                    "(--max-weight-group-setups); try again once one has finished"
                )
            self.s.group_setups += 1
        self.s.used_group_names.add(body.group_name)
        # torch's rendezvous client bounds its connect by the timeout, but then waits without
        # limit for the store to answer: a port that takes the connection and never replies
        # would hold the request forever. The request ends at the timeout instead; the thread
        # keeps its slot until the peer lets go, and a join it completes after that is undone.
        outcome = _Join()

        def join() -> WeightGroup | None:
            try:
                group = init_weight_group(
                    f"tcp://{body.master_address}:{body.master_port}",
                    body.rank_offset,
                    body.world_size,
                    body.group_name,
                    body.backend,
                    setup_timeout=timedelta(seconds=limits.group_setup_timeout),
                )
            finally:
                with self._setup_lock:  # by the thread: a slot is free only once its thread is
                    self.s.group_setups -= 1
            with self._setup_lock:
                if not outcome.abandoned:
                    outcome.delivered = True
                    return group
            destroy_weight_group(group)  # its caller was told that the join failed
            return None

        limit = f"--weight-group-setup-timeout={limits.group_setup_timeout:g}s"
        loop = asyncio.get_running_loop()
        joining = loop.run_in_executor(self._group_threads, join)
        # A little beyond the rendezvous's own limit, so that its error (naming the cause) wins.
        done, _ = await asyncio.wait({joining}, timeout=limits.group_setup_timeout + 2.0)
        if not done:
            with self._setup_lock:
                outcome.abandoned = not outcome.delivered
            if outcome.abandoned:
                joining.add_done_callback(_retrieve)
                return result_response(
                    False,
                    f"Failed to init group: {body.master_address}:{body.master_port} did not complete "
                    f"the rendezvous within {limit}",
                )
        try:
            group = await joining
        except Exception as e:
            return result_response(False, f"Failed to init group: {type(e).__name__}: {e} ({limit})")
        assert group is not None  # not abandoned
        self.s.groups[body.group_name] = group
        print(
            f"joined weight update group {body.group_name!r} as rank {body.rank_offset} of {body.world_size}"
            f" ({body.master_address}:{body.master_port}, {body.backend})",
            flush=True,
        )
        # Beyond SGLang's answer: this engine also takes a sync's buckets as one stream.
        return result_response(
            True, "Succeeded to initialize custom process group.", **{STREAM_CAPABILITY: True}
        )

    async def destroy_group(self, request: web.Request) -> web.Response:
        body: DestroyGroupReq = await read_body(request, DestroyGroupReq, allow_empty=True)
        group = self.s.groups.pop(body.group_name, None)
        if group is None:
            return result_response(False, f"group_name={body.group_name!r} is not an open group")
        await self._on_group_thread(destroy_weight_group, group)
        return result_response(True, "Succeeded to destroy custom process group.")

    async def begin_update(self, request: web.Request) -> web.Response:
        if self.s.session_open:
            return result_response(False, "a weight update session is already open")
        self.s.session_open = True
        return result_response(True, "Weight update session begun.")

    async def end_update(self, request: web.Request) -> web.Response:
        if not self.s.session_open:
            return result_response(False, "no weight update session is open")
        self.s.session_open = False
        return result_response(True, "Weight update session ended.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        body: DistUpdateReq = await read_body(request, DistUpdateReq)
        if not self.s.session_open:
            return result_response(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        group = self.s.groups.get(body.group_name)
        if group is None:
            return result_response(False, f"group_name={body.group_name!r} is not an open group")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return result_response(False, "names, dtypes and shapes must have the same length")
        if body.load_format not in (None, "flattened_bucket"):
            return result_response(False, f"load_format={body.load_format!r} is not supported")
        dtypes = [parse_dtype(d) for d in body.dtypes]
        receive = functools.partial(
            self.s.receiver.receive,
            self.sched.model,
            body.names,
            dtypes,
            body.shapes,
            group,
            body.load_format == "flattened_bucket",
            not self.s.limits.allow_nonfinite_weights,
        )
        failed, _ = await self._receive_between_steps(receive, body.abort_all_requests, body.weight_version)
        if failed is not None:
            return result_response(False, failed)
        return updated_response("Succeeded to update parameter online.", body.weight_version)

    async def update_from_distributed_stream(self, request: web.Request) -> web.Response:
        """Every bucket of one sync in one request (tether.runtime.bucket_stream)."""
        body: DistStreamReq = await read_body(request, DistStreamReq)
        if not self.s.session_open:
            return result_response(
                False,
                f"{STREAM_ENDPOINT} must run between begin_weight_update() and end_weight_update()",
            )
        group = self.s.groups.get(body.group_name)
        if group is None:
            return result_response(False, f"group_name={body.group_name!r} is not an open group")
        receive = functools.partial(
            receive_stream,
            self.s.receiver,
            self.sched.model,
            group,
            body.flattened,
            parse_dtype,
            not self.s.limits.allow_nonfinite_weights,
        )
        failed, buckets = await self._receive_between_steps(
            receive, body.abort_all_requests, body.weight_version
        )
        if failed is not None:
            return result_response(False, failed)
        return updated_response(
            f"Succeeded to update parameter online ({buckets} buckets).", body.weight_version, buckets=buckets
        )

    async def _receive_between_steps(
        self, receive: Callable[[], Any], abort_all_requests: bool, weight_version: str | None
    ) -> tuple[str | None, Any]:
        """Run `receive` on the group's thread between two scheduler steps, under the update
        lock (aborting every request first when asked), then take `weight_version`; returns
        (the refusal, or None, and what `receive` returned)."""
        received: Any = None

        async def op() -> None:
            nonlocal received
            if abort_all_requests:
                self.sched.abort(None, True, "Aborted for a weight update")
                self.sched.apply_aborts()
            self.s.receiving += 1
            try:
                received = await self._on_group_thread(receive)
            finally:
                self.s.receiving -= 1
            if weight_version is not None:
                self.sched.weight_version = weight_version

        try:
            async with self.s.update_lock:
                await self.sched.between_steps(op)
        except WeightMismatch as e:
            return f"Failed to update weights: {e}", None
        return None, received

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        body: TensorUpdateReq = await read_body(request, TensorUpdateReq)
        if not self.s.session_open:  # as SGLang 0.5.23 does
            return result_response(
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if body.load_format not in (None, "direct"):
            return result_response(
                False, f"load_format={body.load_format!r} is not supported by the CPU engine"
            )
        if len(body.serialized_named_tensors) != 1:
            return result_response(
                False,
                f"serialized_named_tensors has {len(body.serialized_named_tensors)} entries; tp_size is 1",
            )
        try:
            named = await asyncio.to_thread(self._decode_checked, body.serialized_named_tensors[0])
            async with self.s.update_lock:
                await self._apply(named, False, body.weight_version, body.abort_all_requests)
        except (PayloadRejected, WeightMismatch) as e:
            return result_response(False, f"Failed to update weights: {e}")
        return updated_response("Succeeded to update model weights.", body.weight_version)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body: VersionReq = await read_body(request, VersionReq)

        async def op() -> None:
            if body.abort_all_requests:
                self.sched.abort(None, True, "Aborted for a weight version update")
                self.sched.apply_aborts()
            self.sched.weight_version = body.new_version

        await self.sched.between_steps(op)
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version,
            }
        )

    async def weights_by_name(self, request: web.Request) -> web.Response:
        body: WeightsByNameReq = await read_body(request, WeightsByNameReq)
        params = self.sched.model.params
        name = (
            "model.embed_tokens.weight"
            if body.name == "lm_head.weight" and self.sched.cfg.tie_embeddings
            else self.sched.cfg.canonical(body.name)
        )
        if name not in params:
            raise BadRequest(f"name={body.name!r}: no such parameter (or the weights are released)")
        return web.json_response(params[name][: body.truncate_size].tolist())

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's /weights_checker (snapshot, reset_tensors, compare, checksum), between two steps."""
        body: CheckWeightsReq = await read_body(request, CheckWeightsReq, allow_empty=True)
        answer: dict[str, Any] = {}

        async def op() -> None:
            answer.update(self._weights_checker.handle(self.sched.model.params, body))

        try:
            async with self.s.update_lock:
                await self.sched.between_steps(op)
        except WeightsCheckFailed as e:
            return result_response(False, str(e))
        return result_response(True, "Success.", **answer)

    async def release_memory(self, request: web.Request) -> web.Response:
        """SGLang's release: no tags means every tag. Unlike SGLang, which requires an idle
        engine, running requests are retracted (they re-prefill once resumed)."""
        body: MemoryReq = await read_body(request, MemoryReq, allow_empty=True)
        tags = memory_tags(body)

        async def op() -> None:
            self.sched.retract_all()  # running sequences lose their KV; they re-prefill on resume
            if "weights" in tags:
                self.sched.model.drop()
                self.s.receiver.release()
            if "kv_cache" in tags:
                self.sched.cache = None
            if "cuda_graph" in tags:
                self.s.cuda_graph_released = True
            if self.sched.model.device.type == "cuda":
                await asyncio.to_thread(_return_gpu_memory)  # a device-wide sync: off the event loop

        await self.sched.between_steps(op)
        return web.json_response({"success": True, "message": f"Released {sorted(tags)}."})

    async def resume_memory(self, request: web.Request) -> web.Response:
        """SGLang's resume: no tags means every tag. Weights come back from the last checkpoint
        loaded from disk (and its version). A tag that is not released is left as it is: SGLang's
        scheduler would fail on it and end the server; an engine that is serving stays so."""
        body: MemoryReq = await read_body(request, MemoryReq, allow_empty=True)
        tags = memory_tags(body)
        named = None
        if "weights" in tags and not self.sched.model.loaded:
            named = await asyncio.to_thread(read_safetensors_dir, self.s.disk_path)
        released = set(self.released_tags())

        async def op() -> None:
            if named is not None and not self.sched.model.loaded:
                # Restored from the last checkpoint loaded from disk, so the version is its version.
                self.sched.model.load(named, complete=True)
                self.sched.weight_version = self.s.disk_version
            if "kv_cache" in tags and self.sched.cache is None:
                self.sched.cache = self.sched.new_cache()
            if "cuda_graph" in tags:
                self.s.cuda_graph_released = False

        await self.sched.between_steps(op)
        message = f"Resumed {sorted(tags & released)}."
        if tags - released:
            message += f" Not released, left as they were: {sorted(tags - released)}."
        return web.json_response({"success": True, "message": message})


def _return_gpu_memory() -> None:
    """Hand the memory of dropped tensors from torch's caching allocator back to the driver, so a
    colocated trainer can have it. cuBLAS keeps a workspace per handle and stream in that
    allocator; it goes too (the next matmul makes a new one)."""
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


@dataclass
class _Join:
    """Who owns a weight-group join that outlived its request (guarded by the setup lock)."""

    abandoned: bool = False  # the request answered "failed": a late group is destroyed
    delivered: bool = False  # the thread handed the group to the request


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Take an abandoned join's outcome, so that its failure is not reported as never retrieved."""
    if not future.cancelled():
        future.exception()


def _is_batched_ids(ids: list[Any] | None) -> bool:
    return bool(ids) and all(isinstance(x, list) for x in ids or [])


def make_app(state: EngineState) -> web.Application:
    return EngineApp(state).build()


__all__ = ["EngineApp", "make_app"]
