"""HTTP client for one generation engine speaking SGLang's native API (real SGLang or tether's CPU engine).

The client only speaks HTTP, so the same code drives both backends (`--rollout-engine sglang|cpu`).
Each engine gets its own aiohttp session, i.e. its own connection pool. Requests are retried
only where a repeat cannot do harm: read-only and idempotent control requests are retried on
connection faults, while a /generate request is resent only when the connection was refused
before anything was sent (its result cannot already have been used). Weight updates are never
retried here: their owner decides, because a half-applied update must be looked at first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import msgspec

from tether.rollout.engine_api.auth import bearer_header
from tether.rollout.engine_api.generate_batch import GenerateBatcher, Pending

if TYPE_CHECKING:
    import aiohttp

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
"""Header carrying the session id; sglang-router (and our router) hash it to pick the engine."""

PauseMode = Literal["abort", "retract", "in_place"]


class EngineError(RuntimeError):
    """An engine answered with an HTTP error (its status and message are kept)."""

    def __init__(self, engine: str, path: str, status: int, message: str) -> None:
        self.engine = engine
        self.path = path
        self.status = status
        self.message = message
        super().__init__(f"engine {engine} {path}: HTTP {status}: {message}")


class EngineUnavailable(ConnectionError):
    """The engine could not be reached (refused, reset, timed out)."""

    def __init__(self, engine: str, path: str, cause: BaseException) -> None:
        self.engine = engine
        self.path = path
        super().__init__(f"engine {engine} {path}: unreachable: {type(cause).__name__}: {cause}")


class EngineResponseError(ValueError):
    """An engine's answer does not have SGLang's shape; the message names the field."""


class FinishReason(msgspec.Struct, kw_only=True):
    type: str
    matched: int | str | list[int] | None = None
    message: str | None = None


class MetaInfo(msgspec.Struct, kw_only=True):
    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    output_token_logprobs: list[list[Any]] | None = None
    weight_version: str | int | None = None
    routed_experts: str | None = None
    """With return_routed_experts (MoE): base64 of int32 [rows, layers, topk], the experts each
    token from `routed_experts_start_len` to the second-to-last was routed to (SGLang's encoding)."""
    routed_experts_start_len: int = 0


class GenerateResponse(msgspec.Struct, kw_only=True):
    """One /generate answer, in SGLang's shape (fields we do not use are ignored)."""

    text: str = ""
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: MetaInfo = msgspec.field(default_factory=MetaInfo)

    @property
    def finish_type(self) -> str:
        """stop | length | abort (abort also when the engine gave no reason)."""
        return self.meta_info.finish_reason.type if self.meta_info.finish_reason else "abort"

    @property
    def weight_version(self) -> str | None:
        v = self.meta_info.weight_version
        return None if v is None else str(v)

    def routed_experts(self) -> tuple[Any, int] | None:
        """(flat int32 numpy array, first token position it covers), or None when the engine sent
        none (return_routed_experts unset, or a dense model)."""
        import binascii

        import numpy as np

        meta = self.meta_info
        if meta.routed_experts is None:
            return None
        if meta.routed_experts_start_len < 0:
            raise EngineResponseError(
                f"meta_info.routed_experts_start_len={meta.routed_experts_start_len} must be >= 0"
            )
        try:
            raw = base64.b64decode(meta.routed_experts, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise EngineResponseError(f"meta_info.routed_experts is not base64: {exc}") from exc
        if len(raw) % 4:
            raise EngineResponseError(f"meta_info.routed_experts holds {len(raw)} bytes, not int32 entries")
        return np.frombuffer(raw, dtype="<i4"), meta.routed_experts_start_len

    def log_probs(self) -> list[float]:
        """Sampled tokens' log-probs, aligned with output_ids (requires return_logprob)."""
        entries = self.meta_info.output_token_logprobs
        if entries is None:
            raise EngineResponseError("meta_info.output_token_logprobs is missing (was return_logprob set?)")
        if len(entries) != len(self.output_ids):
            raise EngineResponseError(
                f"meta_info.output_token_logprobs has {len(entries)} entries for {len(self.output_ids)} output_ids"
            )
        out: list[float] = []
        for pos, (entry, tok) in enumerate(zip(entries, self.output_ids, strict=True)):
            if len(entry) < 2 or not isinstance(entry[0], int | float) or entry[1] != tok:
                raise EngineResponseError(
                    f"meta_info.output_token_logprobs[{pos}]={entry!r} does not match output_ids[{pos}]={tok}"
                )
            out.append(float(entry[0]))
        return out


_generate_decoder = msgspec.json.Decoder(GenerateResponse)
_batch_decoder = msgspec.json.Decoder(list[GenerateResponse])


class _GenerateOptions(NamedTuple):
    """What every prompt of one batched /generate call shares."""

    return_logprob: bool
    routing_key: str | None
    request_timeout: float | None
    return_routed_experts: bool


_BatchKey = tuple[Hashable, _GenerateOptions]


def new_request_id() -> str:
    return uuid.uuid4().hex


class EngineClient:
    """One engine at `url`: an aiohttp connection pool, per-request timeouts, safe retries."""

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        max_connections: int = 512,
        request_timeout: float = 600.0,
        connect_timeout: float = 10.0,
        retries: int = 3,
        retry_backoff: float = 0.2,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the engine's key, sent as `Authorization: Bearer` on every request."""
        self.url = url.rstrip("/")
        self.name = name or self.url
        self._max_connections = max_connections
        self._request_timeout = request_timeout
        self._connect_timeout = connect_timeout
        self._retries = retries
        self._retry_backoff = retry_backoff
        self._auth = bearer_header(api_key)
        self._session: aiohttp.ClientSession | None = None
        self._retired = False
        self._in_flight: set[asyncio.Task[Any]] = set()  # tasks awaiting a request of this client
        self._idle: asyncio.Event | None = None  # set when the last request in flight ends
        self._abandoned: set[asyncio.Task[Any]] = set()  # ... cancelled by `retire`
        self._batcher: GenerateBatcher[_BatchKey, GenerateResponse] = GenerateBatcher(self._generate_batch)

    def __repr__(self) -> str:
        return f"EngineClient({self.name!r}, {self.url!r})"

    # ----- lifecycle -----
    async def __aenter__(self) -> EngineClient:
        self._ensure_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def retire(self, *, abandon_in_flight: bool = False) -> None:
        """Refuse every further request (the engine behind this client is being replaced).

        With `abandon_in_flight`, requests already waiting on it end now with EngineUnavailable
        (a hung engine would otherwise hold them until the request timeout)."""
        self._retired = True
        if abandon_in_flight:
            for task in self._in_flight:
                self._abandoned.add(task)
                task.cancel()

    async def wait_idle(self) -> None:
        """Return once no request of this client is in flight (a drained engine's finish)."""
        while self._in_flight:
            self._idle = asyncio.Event()
            await self._idle.wait()

    async def close(self) -> None:
        await self._batcher.close()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        # aiohttp is imported by the first request, not at import: the head's start imports this
        # module before it starts its processes, and aiohttp's import (~0.1 s) can follow that.
        import aiohttp

        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=self._max_connections
            )
            self._session = aiohttp.ClientSession(connector=connector, raise_for_status=False)
        return self._session

    # ----- transport -----
    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        retry: Literal["never", "connect", "always"] = "always",
        request_timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Send one request; return the decoded JSON (or text) answer.

        retry: "always" for idempotent requests (any connection fault or timeout is retried),
        "connect" when only a refused connection may be retried (nothing reached the engine),
        "never" otherwise.
        """
        raw = await self._request_bytes(
            method, path, body, retry=retry, request_timeout=request_timeout, headers=headers
        )
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return raw.decode("utf-8", errors="replace")  # /flush_cache answers plain text

    async def _request_bytes(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        *,
        retry: Literal["never", "connect", "always"],
        request_timeout: float | None,
        headers: Mapping[str, str] | None,
    ) -> bytes:
        if self._retired:
            # A replaced engine's new process may answer at this URL before it is ready for us.
            raise EngineUnavailable(
                self.name, path, ConnectionAbortedError("the engine was taken out of routing")
            )
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            return await self._send(method, path, body, retry, request_timeout, headers)
        except asyncio.CancelledError:
            if task not in self._abandoned:
                raise
            self._abandoned.discard(task)
            if task.uncancel() > 0:
                raise  # cancelled by its owner too
            raise EngineUnavailable(
                self.name,
                path,
                ConnectionAbortedError("the engine was declared hung and taken out of routing"),
            ) from None
        finally:
            self._in_flight.discard(task)
            if not self._in_flight and self._idle is not None:
                self._idle.set()

    async def _send(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        retry: Literal["never", "connect", "always"],
        request_timeout: float | None,
        headers: Mapping[str, str] | None,
    ) -> bytes:
        import aiohttp  # see _ensure_session

        session = self._ensure_session()
        client_timeout = aiohttp.ClientTimeout(
            total=request_timeout or self._request_timeout, sock_connect=self._connect_timeout
        )
        data = None if body is None else msgspec.json.encode(body)
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(self._auth)
        if headers:
            hdrs.update(headers)
        attempt = 0
        while True:
            attempt += 1
            try:
                async with session.request(
                    method, self.url + path, data=data, headers=hdrs, timeout=client_timeout
                ) as resp:
                    payload = await resp.read()
                    if resp.status >= 400:
                        raise EngineError(self.name, path, resp.status, _error_message(payload))
                    return payload
            except EngineError:
                raise
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                # The connection was never established, so the engine never saw the request.
                if retry == "never" or attempt > self._retries:
                    raise EngineUnavailable(self.name, path, exc) from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                if retry != "always" or attempt > self._retries:
                    raise EngineUnavailable(self.name, path, exc) from exc
            await asyncio.sleep(self._retry_backoff * attempt)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        data: bytes | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        request_timeout: float | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One raw request whose answer (any status, JSON or an SSE stream) the caller reads as it
        arrives: a proxy passing an engine's answer on. Sent again only when the connection was
        refused (nothing reached the engine); other faults raise EngineUnavailable."""
        if self._retired:
            raise EngineUnavailable(
                self.name, path, ConnectionAbortedError("the engine was taken out of routing")
            )
        import aiohttp  # see _ensure_session

        session = self._ensure_session()
        client_timeout = aiohttp.ClientTimeout(
            total=request_timeout or self._request_timeout, sock_connect=self._connect_timeout
        )
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        hdrs.update(self._auth)
        if headers:
            hdrs.update(headers)
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = await session.request(
                    method, self.url + path, data=data, headers=hdrs, timeout=client_timeout
                )
                break
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as exc:
                if attempt > self._retries:
                    raise EngineUnavailable(self.name, path, exc) from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise EngineUnavailable(self.name, path, exc) from exc
            await asyncio.sleep(self._retry_backoff * attempt)
        try:
            yield resp
        finally:
            resp.release()

    # ----- generation -----
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        rid: str | None = None,
        return_logprob: bool = True,
        routing_key: str | None = None,
        request_timeout: float | None = None,
        return_routed_experts: bool = False,
        batch_key: Hashable | None = None,
    ) -> GenerateResponse:
        """POST /generate for one tokenized prompt; the answer keeps the engine's token ids.

        `return_routed_experts` (MoE, --use-rollout-routing-replay): the answer's meta_info carries
        the experts every token of the sequence was routed to (`GenerateResponse.routed_experts`).
        `batch_key`: prompts sent under the same key in the same event-loop iteration go to the
        engine in one batched /generate call (generate_batch.py); each still gets its own answer.
        """
        request = Pending(list(input_ids), dict(sampling_params), rid or new_request_id())
        options = _GenerateOptions(return_logprob, routing_key, request_timeout, return_routed_experts)
        if batch_key is not None:
            return await self._batcher.submit((batch_key, options), request)
        return (await self._generate_batch((None, options), [request]))[0]

    async def _generate_batch(self, key: _BatchKey, requests: list[Pending]) -> list[GenerateResponse]:
        """One /generate call for `requests` (SGLang's batch form when there are several)."""
        return_logprob, routing_key, request_timeout, return_routed_experts = key[1]
        single = len(requests) == 1
        body: dict[str, Any] = {
            "input_ids": requests[0].input_ids if single else [r.input_ids for r in requests],
            "sampling_params": requests[0].sampling_params
            if single
            else [r.sampling_params for r in requests],
            "return_logprob": return_logprob,
            "rid": requests[0].rid if single else [r.rid for r in requests],
        }
        if return_routed_experts:
            body["return_routed_experts"] = True
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        raw = await self._request_bytes(
            "POST", "/generate", body, retry="connect", request_timeout=request_timeout, headers=headers
        )
        try:
            answers = [_generate_decoder.decode(raw)] if single else _batch_decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise EngineResponseError(f"engine {self.name} /generate: {exc}") from exc
        if len(answers) != len(requests):
            raise EngineResponseError(
                f"engine {self.name} /generate: {len(answers)} answers for a batch of {len(requests)} prompts"
            )
        return answers

    # ----- health and info -----
    async def health(self, request_timeout: float = 5.0) -> bool:
        try:
            await self.request("GET", "/health", retry="never", request_timeout=request_timeout)
        except (EngineError, EngineUnavailable):
            return False
        return True

    async def health_generate(self, request_timeout: float = 30.0) -> None:
        """Raises EngineError / EngineUnavailable unless a one-token generation succeeds."""
        await self.request("GET", "/health_generate", retry="never", request_timeout=request_timeout)

    async def wait_ready(self, deadline_s: float, poll_interval: float = 0.2) -> None:
        """Poll /health until it answers 200; TimeoutError after `deadline_s` seconds."""
        async with asyncio.timeout(deadline_s):
            while True:
                if await self.health(request_timeout=max(poll_interval, 1.0)):
                    return
                await asyncio.sleep(poll_interval)

    async def get_model_info(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/get_model_info"))

    async def get_server_info(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/get_server_info"))

    async def get_weight_version(self) -> str | None:
        # SGLang 0.5.23 reports the version only in /get_model_info (/get_weight_version is a 404).
        answer = await self.get_model_info()
        value = answer.get("weight_version")
        return None if value is None else str(value)

    # ----- flow control -----
    async def abort_request(self, rid: str) -> None:
        await self.request("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self.request("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache", None)

    # ----- weights (never retried: the caller inspects a failed update) -----
    async def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None = None, load_format: str | None = None
    ) -> Any:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self.request("POST", "/update_weights_from_disk", body, retry="never")

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Any:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self.request("POST", "/init_weights_update_group", body, retry="never")

    async def begin_weight_update(self) -> Any:
        return await self.request("POST", "/begin_weight_update", {}, retry="never")

    async def end_weight_update(self) -> Any:
        return await self.request("POST", "/end_weight_update", {}, retry="never")

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> Any:
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/update_weights_from_distributed", body, retry="never")

    async def destroy_weights_update_group(self, group_name: str) -> Any:
        return await self.request(
            "POST", "/destroy_weights_update_group", {"group_name": group_name}, retry="never"
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> Any:
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self.request("POST", "/update_weights_from_tensor", body, retry="never")

    async def update_weight_version(self, weight_version: str, *, abort_all_requests: bool = False) -> Any:
        # SGLang aborts running requests by default here; callers opt in explicitly.
        body = {"new_version": weight_version, "abort_all_requests": abort_all_requests}
        return await self.request("POST", "/update_weight_version", body, retry="never")

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self.request(
            "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}
        )

    async def check_weights(self, action: str, *, skip_tensor_list: Sequence[str] | None = None) -> Any:
        """SGLang's /weights_checker: `snapshot`, `reset_tensors`, `compare` (HTTP 400 naming each
        tensor that differs from the snapshot) or `checksum`; never retried (reset is not idempotent)."""
        body: dict[str, Any] = {"action": action}
        if skip_tensor_list is not None:
            body["skip_tensor_list"] = list(skip_tensor_list)
        return await self.request("POST", "/weights_checker", body, retry="never")

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Release `tags` (SGLang: none means every tag); see engine_api.memory for the order."""
        return await self.request("POST", "/release_memory_occupation", _tags_body(tags), retry="never")

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Resume `tags` (SGLang: none means every tag, and each must be released or it fails)."""
        return await self.request("POST", "/resume_memory_occupation", _tags_body(tags), retry="never")


def _tags_body(tags: Sequence[str] | None) -> dict[str, Any]:
    return {} if tags is None else {"tags": list(tags)}


def _error_message(payload: bytes) -> str:
    """SGLang's error body is `{"error": {"message": ...}}`; fall back to the raw text."""
    try:
        doc = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return payload.decode("utf-8", errors="replace")[:500]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in doc:
            return str(doc["message"])
    return payload.decode("utf-8", errors="replace")[:500]
