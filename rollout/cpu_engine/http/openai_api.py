"""The CPU engine's OpenAI-compatible endpoints, in SGLang 0.5's shapes.

`GET /v1/models` (and `/v1/models/{name}`), `POST /v1/completions`, `POST /v1/chat/completions`:
the subset of SGLang's OpenAI API that agent code uses through the official `openai` client.

- Completions: `prompt` as text, texts, token ids or lists of them; `n`, `max_tokens`,
  `temperature`/`top_p`/`top_k`/`min_p`, `stop`/`stop_token_ids`, `seed`, `logprobs` (top-N),
  `echo` (without logprobs), `stream` (SSE ending `data: [DONE]`, `stream_options.include_usage`),
  and SGLang's `return_token_ids` (`choices[].token_ids`/`prompt_token_ids`).
- Chat: the model's chat template (tokenizer_config.json) applied by transformers'
  `apply_chat_template` with `tools`; `n`, `logprobs`/`top_logprobs`, `seed`, `stream`, `tools`
  with `tool_choice` auto / none / required / a named function (the last two constrain the
  output as SGLang does, see constrained.py), tool calls parsed into `message.tool_calls` by the
  engine's `--tool-call-parser` (qwen25, qwen, hermes), `continue_final_message`,
  `chat_template_kwargs`, `input_ids` (a pre-tokenized prompt), and SGLang's
  `return_prompt_token_ids`/`return_token_ids` (`choices[].prompt_token_ids`/
  `response_token_ids`), `return_meta_info` (`choices[].meta_info`, the native /generate
  meta_info with `output_token_logprobs`) and `return_input_ids_in_sglext`/
  `return_output_ids_in_sglext` (`sglext.input_ids`/`output_ids`, in streams too).

Token ids and log-probs come from the scheduler, so a turn's tokens are exactly the ones
sampled (no re-tokenization). Bad parameters answer 400 naming the field and value, in SGLang's
error shape (which also carries OpenAI's `error` object); fields SGLang supports and this engine
does not (logit_bias, regex, ebnf, json_schema, response_format, best_of, suffix, stop_regex,
penalties) are refused with 400 rather than ignored. The engine key, the body size limit and
--max-prompts-per-request (prompts × n) apply as for /generate.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
from aiohttp import web

from tether.rollout.cpu_engine.constrained import GrammarConstraint, TokenConstraint, Vocab
from tether.rollout.cpu_engine.http.common import BadRequest, EngineState, read_body
from tether.rollout.cpu_engine.http.sse import send_events
from tether.rollout.cpu_engine.http.tool_calls import (
    FORMATS,
    ParsedCall,
    ToolDef,
    ToolFormat,
    holdback,
    json_array_constraint,
    new_call_id,
    parse_tool_calls,
    structural_constraint,
)
from tether.rollout.cpu_engine.sampling import SamplingParams
from tether.rollout.cpu_engine.scheduler import Request, Scheduler, progress

MAX_TOP_LOGPROBS = 20
UNSET = msgspec.UNSET
Unset = msgspec.UnsetType

# ----- requests (unknown fields are ignored, as SGLang's pydantic models do) -----


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str = "default"
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    rid: str | list[str] | None = None
    # Supported by SGLang, not by this engine: refused when set (see `_refuse_unsupported`).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    regex: str | None = None
    ebnf: str | None = None
    response_format: dict[str, Any] | None = None
    stop_regex: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None


class CompletionReq(_Common, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    echo: bool = False
    return_token_ids: bool = False
    best_of: int | None = None
    suffix: str | None = None
    json_schema: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionIn(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(msgspec.Struct, kw_only=True):
    function: FunctionIn
    id: str | None = None
    index: int | None = None
    type: str = "function"


class MessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = None


class ToolChoiceFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    function: ToolChoiceFunction
    type: Literal["function"] = "function"


ROLES = ("system", "user", "assistant", "tool", "developer", "function")


class ChatReq(_Common, kw_only=True):
    messages: list[MessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    input_ids: list[int] | None = None
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_meta_info: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False
    separate_reasoning: bool = True


# ----- responses -----


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "tether"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: None = None
    reasoning_tokens: int = 0
    completion_tokens_details: None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    token_ids: list[int] | Unset = UNSET
    prompt_token_ids: list[int] | Unset = UNSET


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metadata: dict[str, Any] | Unset = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob]


class FunctionOut(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str | None
    index: int
    type: str = "function"
    function: FunctionOut


class MessageOut(msgspec.Struct, kw_only=True):
    role: str | Unset | None = UNSET
    content: str | Unset | None = UNSET
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | Unset = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: MessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_token_ids: list[int] | Unset = UNSET
    response_token_ids: list[int] | Unset = UNSET
    meta_info: dict[str, Any] | Unset = UNSET


class StreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: MessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class SglExt(msgspec.Struct, kw_only=True, omit_defaults=True):
    input_ids: list[int] | None = None
    output_ids: list[list[int]] | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[Any]
    """ChatChoice entries, or StreamChoice entries in a stream's chunks."""
    usage: Usage | None = None
    metadata: dict[str, Any] | Unset = UNSET
    sglext: SglExt | Unset = UNSET


_encoder = msgspec.json.Encoder()


def _sse(chunk: msgspec.Struct) -> bytes:
    return b"data: " + _encoder.encode(chunk) + b"\n\n"


# ----- token texts -----


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte is stored as → the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenTexts:
    """Per token: its display text, its raw bytes, and the lossless text of completions' logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        try:
            decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        except (ValueError, AttributeError):
            decoder = {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int], str]] = {}

    def get(self, tid: int) -> tuple[str, list[int], str]:
        hit = self._cache.get(tid)
        if hit is not None:
            return hit
        try:
            display = self._tok.decode([tid], skip_special_tokens=False)
        except Exception:  # an id past the tokenizer's vocabulary (padded embeddings)
            display = ""
        raw: list[int] | None = None
        piece = self._tok.id_to_token(tid) if self._byte_level else None
        if piece:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                raw = [table[ch] for ch in piece]
        if raw is None:
            raw = list(display.encode("utf-8"))
        lossless = display
        if "\ufffd" in display:
            try:
                bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                lossless = bytes(raw).decode("latin-1")
        entry = (display, raw, lossless)
        self._cache[tid] = entry
        return entry


# ----- the endpoints -----


class EngineCore(Protocol):
    """What the routes use of the engine's app (`http_api.EngineApp`, which mounts them over itself)."""

    s: EngineState

    @property
    def sched(self) -> Scheduler: ...

    @property
    def tokenize_threads(self) -> ThreadPoolExecutor: ...

    def encode(self, texts: list[str]) -> list[list[int]]: ...

    def submit_all(self, reqs: list[Request]) -> None: ...

    async def wait_all(self, reqs: list[Request]) -> None: ...


class OpenAIRoutes:
    """/v1/* over one engine's scheduler (see the module docstring)."""

    def __init__(self, app: EngineCore) -> None:
        self.app = app
        self._hf_tokenizer: Any = None
        self._vocab: Vocab | None = None
        self._load_lock = asyncio.Lock()
        self._texts: TokenTexts | None = None
        self._defaults: dict[str, Any] | None = None

    @property
    def sched(self) -> Any:
        return self.app.sched

    @property
    def served_name(self) -> str:
        return self.app.s.served_model_name or self.app.s.model_path

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model:.+}", self.model)
        router.add_post("/v1/completions", self.completions)
        router.add_post("/v1/chat/completions", self.chat)

    # ----- helpers -----

    def texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.sched.tokenizer)
        return self._texts

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.app.tokenize_threads, fn, *args)

    async def hf_tokenizer(self) -> Any:
        """transformers' tokenizer of the served model (for its chat template), loaded once."""
        async with self._load_lock:
            if self._hf_tokenizer is None:
                self._hf_tokenizer = await self._off_loop(_load_hf_tokenizer, self.app.s.model_path)
        return self._hf_tokenizer

    async def vocab(self) -> Vocab:
        async with self._load_lock:
            if self._vocab is None:
                self._vocab = await self._off_loop(_vocab_of, self.sched)
        return self._vocab

    async def defaults(self) -> dict[str, Any]:
        """The model's sampling defaults (generation_config.json), as SGLang's chat endpoint uses them."""
        async with self._load_lock:
            if self._defaults is None:
                self._defaults = await self._off_loop(_sampling_defaults, self.app.s.model_path)
        return self._defaults

    def _check_prompt(self, prompt: list[int], where: str, max_new_tokens: int | None) -> None:
        ctx, vocab = self.sched.context_length, self.sched.cfg.vocab
        if not prompt:
            raise BadRequest(f"{where}: the prompt is empty")
        if len(prompt) >= ctx:
            raise BadRequest(
                f"The input ({len(prompt)} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if max_new_tokens is not None and len(prompt) + max_new_tokens > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {len(prompt) + max_new_tokens} tokens: {len(prompt)} tokens from "
                f"the input messages and {max_new_tokens} tokens for the completion. Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit."
            )

    def _check_count(self, prompts: int, n: int) -> None:
        limit = self.app.s.limits.max_prompts_per_request
        if n < 1:
            raise BadRequest(f"n={n}: must be at least 1")
        if prompts * n > limit:
            raise BadRequest(
                f"the request asks for {prompts * n} generations ({prompts} prompts x n={n}); this engine "
                f"takes at most {limit} per request (--max-prompts-per-request)"
            )

    def _requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        base_id: str,
        top_logprobs: int,
        constraint: TokenConstraint | None = None,
    ) -> list[Request]:
        now = time.monotonic()
        total = len(prompts) * n
        return [
            Request(
                rid=base_id if total == 1 else f"{base_id}_{i * n + j}",
                prompt=list(prompt),
                params=params,
                return_logprob=True,
                generator=self.sched.new_generator(params.sampling_seed),
                ready_at=now + self.app.s.delay(),
                top_logprobs_num=top_logprobs,
                constraint=constraint,
            )
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]

    def _usage(self, reqs: list[Request], n: int) -> Usage:
        prompt = sum(len(r.prompt) for r in reqs[::n])
        completion = sum(len(r.output) for r in reqs)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def _metadata(self, req: Request) -> dict[str, Any]:
        version = req.weight_version or self.sched.weight_version
        return {
            "weight_version": version,
            "weight_versions": [{"version": version, "start": 0, "end": len(req.output)}],
        }

    @staticmethod
    def _finish(req: Request) -> tuple[str | None, int | str | None]:
        reason = req.finish
        if reason is None:
            return None, None
        return str(reason["type"]), reason.get("matched")

    def _visible_text(self, req: Request) -> str:
        """The output's text so far; while generating, without a trailing partial character."""
        text = str(self.sched.output_text(req))
        if req.finish is None:
            text = text.rstrip("\ufffd")
        return text

    async def _stream(
        self, request: web.Request, reqs: list[Request], chunks: AsyncIterator[bytes]
    ) -> web.StreamResponse:
        def abort() -> None:
            for req in reqs:
                self.sched.abort(req.rid, False, "client disconnected")

        return await send_events(request, chunks, abort)

    # ----- /v1/models -----

    def _card(self) -> ModelCard:
        name = self.served_name
        return ModelCard(
            id=name, root=name, created=int(time.time()), max_model_len=self.sched.context_length
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(body=_encoder.encode(ModelList(data=[self._card()])))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.served_name:
            body = {
                "error": {
                    "message": f"The model '{name}' does not exist",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }
            }
            return web.json_response(body, status=404)
        return web.json_response(body=_encoder.encode(self._card()))

    # ----- /v1/completions -----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionReq = await read_body(request, CompletionReq)
        _refuse_unsupported(body, best_of=body.best_of, suffix=body.suffix, json_schema=body.json_schema)
        if body.repetition_penalty != 1.0:
            raise BadRequest(
                f"repetition_penalty={body.repetition_penalty!r}: is not supported by the CPU engine"
            )
        if body.max_tokens <= 0:
            raise BadRequest(f"max_tokens={body.max_tokens}: must be positive")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs={body.logprobs}: must be in [0, {MAX_TOP_LOGPROBS}]")
        if body.echo and body.logprobs is not None:
            raise BadRequest(
                "echo=true with logprobs: prompt log-probs are not supported by the CPU engine "
                "(use /generate, or drop one of them)"
            )
        prompts_raw = _completion_prompts(body.prompt)
        self._check_count(len(prompts_raw), body.n)
        texts = [p for p in prompts_raw if isinstance(p, str)]
        encoded = iter(await self._off_loop(self.app.encode, texts) if texts else [])
        prompts = [next(encoded) if isinstance(p, str) else p for p in prompts_raw]
        params = _sampling(
            max_new_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            body=body,
        )
        for i, prompt in enumerate(prompts):
            self._check_prompt(
                prompt, "prompt" if len(prompts) == 1 else f"prompt[{i}]", params.max_new_tokens
            )
        base_id = uuid.uuid4().hex
        reqs = self._requests(prompts, params, body.n, base_id, body.logprobs or 0)
        self.app.submit_all(reqs)
        echoes = [p if isinstance(p, str) else "" for p in prompts_raw]
        if body.echo:
            tok = self.sched.tokenizer
            echoes = [
                p if isinstance(p, str) else tok.decode(p, skip_special_tokens=True) for p in prompts_raw
            ]
        created = int(time.time())
        if body.stream:
            return await self._stream(
                request, reqs, self._completion_chunks(body, reqs, base_id, created, echoes)
            )
        await self.app.wait_all(reqs)
        choices = []
        for idx, req in enumerate(reqs):
            finish, matched = self._finish(req)
            text = self.sched.output_text(req)
            choices.append(
                CompletionChoice(
                    index=idx,
                    text=(echoes[idx // body.n] + text) if body.echo else text,
                    logprobs=self._completion_logprobs(req, 0) if body.logprobs is not None else None,
                    finish_reason=finish,
                    matched_stop=matched,
                    token_ids=list(req.output) if body.return_token_ids else UNSET,
                    prompt_token_ids=list(req.prompt) if body.return_token_ids else UNSET,
                )
            )
        out = Completion(
            id=base_id,
            created=created,
            model=body.model,
            choices=choices,
            usage=self._usage(reqs, body.n),
            metadata=self._metadata(reqs[0]),
        )
        return web.json_response(body=_encoder.encode(out))

    def _completion_logprobs(self, req: Request, start: int, end: int | None = None) -> CompletionLogprobs:
        texts = self.texts()
        ids = req.output[start:end]
        lps = req.logprobs[start:end]
        tops = req.top_logprobs[start:end] if req.top_logprobs_num > 0 else []
        return CompletionLogprobs(
            text_offset=[-1] * len(ids),
            token_logprobs=list(lps),
            tokens=[texts.get(t)[2] for t in ids],
            top_logprobs=[{texts.get(t)[2]: lp for lp, t in row} for row in tops],
        )

    async def _completion_chunks(
        self, body: CompletionReq, reqs: list[Request], base_id: str, created: int, echoes: list[str]
    ) -> AsyncIterator[bytes]:
        chars = dict.fromkeys(range(len(reqs)), 0)
        tokens = dict.fromkeys(range(len(reqs)), 0)
        echoed: set[int] = set()
        async for idx, req in progress(reqs):
            text = self._visible_text(req)
            delta = text[chars[idx] :]
            if body.echo and idx not in echoed:
                echoed.add(idx)
                delta = echoes[idx // body.n] + delta
            chars[idx] = len(text)
            now = len(req.output)
            finish, matched = self._finish(req)
            choice = CompletionChoice(
                index=idx,
                text=delta,
                logprobs=self._completion_logprobs(req, tokens[idx], now)
                if body.logprobs is not None
                else None,
                finish_reason=finish,
                matched_stop=matched,
                token_ids=list(req.output[tokens[idx] : now]) if body.return_token_ids else UNSET,
                prompt_token_ids=list(req.prompt) if body.return_token_ids and tokens[idx] == 0 else UNSET,
            )
            tokens[idx] = now
            usage = self._usage(reqs, body.n) if _continuous(body.stream_options) else None
            yield _sse(
                Completion(id=base_id, created=created, model=body.model, choices=[choice], usage=usage)
            )
        if _include_usage(body.stream_options):
            yield _sse(
                Completion(
                    id=base_id, created=created, model=body.model, choices=[], usage=self._usage(reqs, body.n)
                )
            )

    # ----- /v1/chat/completions -----

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatReq = await read_body(request, ChatReq)
        _refuse_unsupported(body)
        turn = await self._prepare_chat(body)
        max_new = body.max_completion_tokens or body.max_tokens
        if max_new is not None and max_new < 0:
            field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise BadRequest(f"{field}={max_new}: must be >= 0")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs={body.top_logprobs}: must be in [0, {MAX_TOP_LOGPROBS}]")
        if body.stream:
            for name in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
                if getattr(body, name):
                    raise BadRequest(
                        f"{name} is not supported with streaming. Please set stream=false when using "
                        f"{name}=true (or use return_input_ids_in_sglext / return_output_ids_in_sglext)."
                    )
        self._check_count(1, body.n)
        ctx = self.sched.context_length
        if max_new is not None and max_new > ctx:
            raise BadRequest(
                f"max_completion_tokens is too large: {max_new}. This model supports at most {ctx} completion tokens."
            )
        self._check_prompt(turn.prompt, "input_ids" if body.input_ids is not None else "messages", max_new)
        defaults = await self.defaults()

        def pick(name: str, value: Any, default: Any) -> Any:
            return value if value is not None else defaults.get(name, default)

        if pick("repetition_penalty", body.repetition_penalty, 1.0) != 1.0:
            raise BadRequest(
                f"repetition_penalty={body.repetition_penalty!r}: is not supported by the CPU engine"
            )
        params = _sampling(
            max_new_tokens=max_new if max_new is not None else ctx - len(turn.prompt),
            temperature=pick("temperature", body.temperature, 1.0),
            top_p=pick("top_p", body.top_p, 1.0),
            top_k=pick("top_k", body.top_k, -1),
            min_p=pick("min_p", body.min_p, 0.0),
            body=body,
            skip_special_tokens=body.skip_special_tokens and not turn.tools_active,
        )
        base_id = uuid.uuid4().hex
        top = (body.top_logprobs or 0) if body.logprobs else 0
        reqs = self._requests([turn.prompt], params, body.n, base_id, top, turn.constraint)
        self.app.submit_all(reqs)
        created = int(time.time())
        if body.stream:
            return await self._stream(request, reqs, self._chat_chunks(body, turn, reqs, base_id, created))
        await self.app.wait_all(reqs)
        choices = []
        for idx, req in enumerate(reqs):
            finish, matched = self._finish(req)
            text = self.sched.output_text(req)
            calls: list[ToolCallOut] | Unset = UNSET
            if turn.parser is not None:
                text, parsed = parse_tool_calls(text, turn.parser, turn.tools)
                if parsed:
                    calls = _tool_calls_out(parsed)
                    if finish == "stop":
                        finish, matched = "tool_calls", None
            meta: dict[str, Any] | Unset = UNSET
            if body.return_meta_info:
                meta = self._meta_info(req)
            choices.append(
                ChatChoice(
                    index=idx,
                    message=MessageOut(role="assistant", content=text or "", tool_calls=calls),
                    logprobs=self._chat_logprobs(req, 0) if body.logprobs else None,
                    finish_reason=finish,
                    matched_stop=matched,
                    prompt_token_ids=(
                        list(req.prompt) if body.return_prompt_token_ids or body.return_token_ids else UNSET
                    ),
                    response_token_ids=list(req.output) if body.return_token_ids else UNSET,
                    meta_info=meta,
                )
            )
        out = ChatCompletion(
            id=base_id,
            created=created,
            model=body.model,
            choices=choices,
            usage=self._usage(reqs, body.n),
            metadata=self._metadata(reqs[0]),
            sglext=self._sglext(body, reqs),
        )
        return web.json_response(body=_encoder.encode(out))

    def _sglext(self, body: ChatReq, reqs: list[Request]) -> SglExt | Unset:
        if not (body.return_input_ids_in_sglext or body.return_output_ids_in_sglext):
            return UNSET
        return SglExt(
            input_ids=list(reqs[0].prompt) if body.return_input_ids_in_sglext else None,
            output_ids=[list(r.output) for r in reqs] if body.return_output_ids_in_sglext else None,
        )

    def _meta_info(self, req: Request) -> dict[str, Any]:
        """The native /generate meta_info, with each log-prob entry's token text (SGLang's
        `return_text_in_logprobs`)."""
        meta: dict[str, Any] = dict(self.sched.response(req)["meta_info"])
        texts = self.texts()
        for key in ("output_token_logprobs",):
            if key in meta:
                meta[key] = [[lp, tok, texts.get(tok)[0]] for lp, tok, _ in meta[key]]
        if "output_top_logprobs" in meta:
            meta["output_top_logprobs"] = [
                [[lp, tok, texts.get(tok)[0]] for lp, tok, _ in row] for row in meta["output_top_logprobs"]
            ]
        return meta

    def _chat_logprobs(self, req: Request, start: int, end: int | None = None) -> ChoiceLogprobs:
        texts = self.texts()
        ids = req.output[start:end]
        lps = req.logprobs[start:end]
        tops = req.top_logprobs[start:end] if req.top_logprobs_num > 0 else [[] for _ in ids]
        content = []
        for tok, lp, row in zip(ids, lps, tops, strict=True):
            display, raw, _ = texts.get(tok)
            content.append(
                TokenLogprob(
                    token=display,
                    bytes=raw,
                    logprob=lp,
                    top_logprobs=[
                        TopLogprob(token=texts.get(t)[0], bytes=texts.get(t)[1], logprob=v) for v, t in row
                    ],
                )
            )
        return ChoiceLogprobs(content=content)

    async def _chat_chunks(
        self, body: ChatReq, turn: ChatTurn, reqs: list[Request], base_id: str, created: int
    ) -> AsyncIterator[bytes]:
        n = len(reqs)
        chars = dict.fromkeys(range(n), 0)
        tokens = dict.fromkeys(range(n), 0)
        calls_sent = dict.fromkeys(range(n), 0)
        started: set[int] = set()
        finishes: dict[int, tuple[str | None, int | str | None]] = {}

        def chunk(choices: list[StreamChoice], usage: Usage | None = None) -> bytes:
            return _sse(
                ChatCompletion(
                    id=base_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=body.model,
                    choices=choices,
                    usage=usage,
                )
            )

        async for idx, req in progress(reqs):
            if idx not in started:
                started.add(idx)
                yield chunk([StreamChoice(index=idx, delta=MessageOut(role="assistant", content=""))])
            text = self._visible_text(req)
            now = len(req.output)
            logprobs = self._chat_logprobs(req, tokens[idx], now) if body.logprobs else None
            tokens[idx] = now
            usage = self._usage(reqs, n) if _continuous(body.stream_options) else None
            if turn.parser is None:
                if len(text) > chars[idx] or logprobs is not None:
                    yield chunk(
                        [
                            StreamChoice(
                                index=idx, delta=MessageOut(content=text[chars[idx] :]), logprobs=logprobs
                            )
                        ],
                        usage,
                    )
                chars[idx] = len(text)
            else:
                visible = holdback(text, turn.parser)
                if visible > chars[idx]:
                    yield chunk(
                        [StreamChoice(index=idx, delta=MessageOut(content=text[chars[idx] : visible]))], usage
                    )
                    chars[idx] = visible
                _, parsed = parse_tool_calls(text, turn.parser, turn.tools)
                for k, call in enumerate(parsed[calls_sent[idx] :], start=calls_sent[idx]):
                    head = ToolCallOut(
                        id=new_call_id(), index=k, function=FunctionOut(name=call.name, arguments="")
                    )
                    args = ToolCallOut(id=None, index=k, function=FunctionOut(arguments=call.arguments))
                    for part in (head, args):
                        yield chunk([StreamChoice(index=idx, delta=MessageOut(tool_calls=[part]))])
                calls_sent[idx] = len(parsed)
            if req.finish is not None:
                finishes[idx] = self._finish(req)
        for idx in sorted(finishes):
            finish, matched = finishes[idx]
            if calls_sent[idx] and finish == "stop":
                finish, matched = "tool_calls", None
            yield chunk(
                [StreamChoice(index=idx, delta=MessageOut(), finish_reason=finish, matched_stop=matched)]
            )
        sglext = self._sglext(body, reqs)
        if not isinstance(sglext, msgspec.UnsetType):
            yield _sse(
                ChatCompletion(
                    id=base_id,
                    object="chat.completion.chunk",
                    created=created,
                    model=body.model,
                    choices=[],
                    sglext=sglext,
                )
            )
        if _include_usage(body.stream_options):
            yield chunk([], self._usage(reqs, n))

    async def _prepare_chat(self, body: ChatReq) -> ChatTurn:
        """Validate the conversation and tools, render the prompt, and pick the constraint."""
        if not body.messages:
            raise BadRequest("messages: Messages cannot be empty.")
        tools: list[ToolDef] = []
        for i, raw in enumerate(body.tools or []):
            try:
                tools.append(msgspec.convert(raw, ToolDef))
            except msgspec.ValidationError as e:
                raise BadRequest(f"tools[{i}]: {e}") from e
            if not isinstance(raw.get("function"), dict) or not tools[-1].function.name:
                raise BadRequest(f"tools[{i}].function.name: must be a non-empty string")
        names = [t.function.name for t in tools]
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if choice == "required" and not tools:
            raise BadRequest(
                "tool_choice='required': Tools cannot be empty if tool choice is set to required."
            )
        if isinstance(choice, NamedToolChoice):
            if not tools:
                raise BadRequest(
                    f"tool_choice={choice.function.name!r}: Tools cannot be empty if tool choice is set to a "
                    "specific tool."
                )
            if choice.function.name not in names:
                raise BadRequest(
                    f"tool_choice.function.name={choice.function.name!r}: Tool '{choice.function.name}' not "
                    "found in tools list."
                )
        active = bool(tools) and choice != "none"
        template_tools: list[dict[str, Any]] | None = None
        chosen = tools
        if active:
            if isinstance(choice, NamedToolChoice):
                chosen = [t for t in tools if t.function.name == choice.function.name]
                template_tools = [
                    raw
                    for raw in body.tools or []
                    if (raw.get("function") or {}).get("name") == choice.function.name
                ]
            else:
                template_tools = list(body.tools or [])
        messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
        kwargs = dict(body.chat_template_kwargs or {})
        if "chat_template" in kwargs:
            raise BadRequest(
                "chat_template_kwargs.chat_template: Request-supplied chat_template is not allowed."
            )
        if body.input_ids is not None:
            prompt = list(body.input_ids)
        else:
            tokenizer = await self.hf_tokenizer()
            try:
                prompt = await self._off_loop(
                    _render, tokenizer, messages, template_tools, body.continue_final_message, kwargs
                )
            except Exception as e:  # the template's own errors (raise_exception, bad types) are the caller's
                raise BadRequest(f"messages: the chat template failed: {type(e).__name__}: {e}") from e
        parser_name = self.app.s.tool_call_parser
        parser = FORMATS[parser_name] if parser_name is not None and active else None
        constraint: GrammarConstraint | None = None
        if active and (choice == "required" or isinstance(choice, NamedToolChoice)):
            vocab = await self.vocab()
            try:
                if parser is not None:
                    constraint = structural_constraint(parser, chosen, vocab)
                else:
                    constraint = json_array_constraint(chosen, vocab, body.parallel_tool_calls)
            except ValueError as e:
                raise BadRequest(f"tools: {e}") from e
        return ChatTurn(prompt=prompt, tools=tools, tools_active=active, parser=parser, constraint=constraint)


class ChatTurn(msgspec.Struct, kw_only=True):
    """A validated chat request, ready to generate."""

    prompt: list[int]
    tools: list[ToolDef]
    tools_active: bool
    parser: ToolFormat | None
    constraint: GrammarConstraint | None


def _tool_calls_out(calls: list[ParsedCall]) -> list[ToolCallOut]:
    return [
        ToolCallOut(id=new_call_id(), index=k, function=FunctionOut(name=c.name, arguments=c.arguments))
        for k, c in enumerate(calls)
    ]


def _include_usage(options: StreamOptions | None) -> bool:
    return bool(options and options.include_usage)


def _continuous(options: StreamOptions | None) -> bool:
    return bool(options and options.continuous_usage_stats)


def _refuse_unsupported(body: _Common, **extra: Any) -> None:
    fields = {
        "frequency_penalty": (body.frequency_penalty, 0.0),
        "presence_penalty": (body.presence_penalty, 0.0),
        "logit_bias": (body.logit_bias, None),
        "regex": (body.regex, None),
        "ebnf": (body.ebnf, None),
        "response_format": (body.response_format, None),
        "stop_regex": (body.stop_regex, None),
        "lora_path": (body.lora_path, None),
        **{k: (v, None) for k, v in extra.items()},
    }
    for name, (value, default) in fields.items():
        if value != default:
            raise BadRequest(f"{name}={value!r}: is not supported by the CPU engine")


_PARAM_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


def _sampling(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    body: _Common,
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """SamplingParams from OpenAI fields; a bad value is refused naming the OpenAI field."""
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            min_new_tokens=body.min_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            no_stop_trim=body.no_stop_trim,
            skip_special_tokens=body.skip_special_tokens
            if skip_special_tokens is None
            else skip_special_tokens,
            sampling_seed=body.seed,
        )
    except ValueError as e:
        message = str(e).removeprefix("sampling_params.")
        for ours, theirs in _PARAM_NAMES.items():
            message = message.replace(ours, theirs)
        raise BadRequest(message) from e


def _completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of /v1/completions: a text, texts, token ids, or lists of token ids."""

    def ids(value: Any, where: str) -> list[int]:
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise BadRequest(f"{where}: must be a string, a list of token ids, or a list of either")
        return value

    if isinstance(prompt, str):
        out: list[str | list[int]] = [prompt]
    elif all(isinstance(p, str) for p in prompt):
        out = list(prompt)
    elif all(isinstance(p, list) for p in prompt):
        out = [ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        out = [ids(prompt, "prompt")]
    if not out or all(not p for p in out):
        raise BadRequest("prompt: Prompt cannot be empty")
    return out


def _template_message(i: int, m: MessageIn) -> dict[str, Any]:
    """One message as chat templates read it (SGLang's normalisation for string templates)."""
    if m.role.lower() not in ROLES:
        raise BadRequest(f"messages[{i}].role={m.role!r}: must be one of {', '.join(ROLES)}")
    role = m.role.lower()
    if role == "user" and m.content is None:
        raise BadRequest(f"messages[{i}].content: a user message needs content")
    content: str
    if isinstance(m.content, list):
        parts = []
        for j, part in enumerate(m.content):
            if part.type not in ("text", "input_text"):
                raise BadRequest(
                    f"messages[{i}].content[{j}].type={part.type!r}: Model only supports text input"
                )
            parts.append(part.text or "")
        content = " ".join(parts)
    else:
        content = m.content or ""
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    if m.tool_calls is not None:
        calls = []
        for j, call in enumerate(m.tool_calls):
            arguments: Any = call.function.arguments
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError as e:
                    raise BadRequest(
                        f"messages[{i}].tool_calls[{j}].function.arguments={call.function.arguments!r}: "
                        f"not valid JSON ({e})"
                    ) from e
            entry: dict[str, Any] = {
                "type": call.type,
                "function": {"name": call.function.name, "arguments": arguments},
            }
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        out["tool_calls"] = calls
    return out


def _sampling_defaults(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "generation_config.json"
    try:
        raw = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        raw = {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: raw[k] for k in keys if isinstance(raw, dict) and k in raw}


def _load_hf_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _vocab_of(sched: Any) -> Vocab:
    tok = sched.tokenizer
    special = {tid for tid, added in tok.get_added_tokens_decoder().items() if added.special}
    return Vocab.from_decoder(
        sched.cfg.vocab,
        lambda tid: tok.decode([tid], skip_special_tokens=False),
        special,
        sched.cfg.eos_token_ids,
    )


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    continue_final: bool,
    kwargs: dict[str, Any],
) -> list[int]:
    """Worker thread: the prompt's token ids, rendered by the model's chat template.

    With `continue_final` and a final assistant message, the template renders the messages
    before it with the generation prompt and the message's text follows, as SGLang does."""
    prefix = ""
    if continue_final and messages and messages[-1]["role"] == "assistant":
        prefix = str(messages[-1].get("content") or "")
        messages = messages[:-1]
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=True, **kwargs
    )
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if prefix:
        ids += tokenizer.encode(prefix, add_special_tokens=False)
    return ids


__all__ = ["ChatReq", "CompletionReq", "OpenAIRoutes"]
