"""Continuous batching for the CPU engine.

One asyncio task (owned by the HTTP app) runs the loop; each iteration first runs the queued
control operations (weight updates, pause, release...) so they always fall between two
steps, then applies aborts, then runs one model step in a worker thread: the prompts admitted
this iteration are prefilled and every running sequence advances one token, in one call. A
request that arrives while others decode is admitted at the next iteration and joins the batch.

The forward pass has a thread of its own, so no other blocking work of the engine (tokenizing,
reading weights from disk, joining a weight group) can leave it waiting for a worker. If the
loop itself fails (the model raises), every request ends at once with an abort naming the
error, later work is refused, and the task's owner ends the process: a scheduler that is gone
must not leave an engine that answers but never generates.
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tokenizers import Tokenizer

from tether.rollout.cpu_engine.constrained import TokenConstraint
from tether.rollout.cpu_engine.modeling.model import KVCache, ModelConfig, Routes, TinyLM
from tether.rollout.cpu_engine.prompt_logprobs import PromptScore, score_prompt, wants_scoring
from tether.rollout.cpu_engine.sampling import Choice, SamplingParams, choose_tokens

T = TypeVar("T")


@dataclass(eq=False)
class Request:
    """One prompt's generation; the scheduler is the only writer after submission."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    return_logprob: bool
    generator: torch.Generator
    ready_at: float = 0.0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    slot: int | None = None
    finish: dict[str, Any] | None = None
    text_end: int | None = None  # where a matched stop string starts in the decoded text
    weight_version: str = ""
    abort_message: str | None = None
    top_logprobs_num: int = 0
    """How many of the most likely tokens to report at each output position (SGLang's name)."""
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    constraint: TokenConstraint | None = None
    """Constrained decoding: which tokens the output may continue with (None: any)."""
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    """The first token position whose routed experts are returned (SGLang's name)."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """Routed experts of each forwarded token position, in order: chunks of [n, layers, top_k]."""
    logprob_start_len: int = -1
    """SGLang's name: the first prompt position whose log-prob is returned (-1: none)."""
    prompt_score: PromptScore | None = None
    """The prompt's log-probs from logprob_start_len on, once its first prefill has run."""
    return_text_in_logprobs: bool = False
    """Each log-prob entry carries its token's text (SGLang's name), else None."""
    created: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)


class EngineUnavailable(RuntimeError):
    """The engine cannot take generation work now (weights released)."""


class Scheduler:
    """Owns the model, the KV cache, the weight version and every request's state."""

    def __init__(
        self,
        cfg: ModelConfig,
        model: TinyLM,
        tokenizer: Tokenizer,
        weight_version: str,
        context_length: int,
        max_running: int,
        original_logprob: bool,
        seed: int,
        return_routed_experts: bool = False,
    ) -> None:
        self.cfg = cfg
        self.return_routed_experts = return_routed_experts
        """The engine records the experts each token is routed to (--enable-return-routed-experts)."""
        self.model = model
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.context_length = context_length
        self.max_running = max_running
        self.original_logprob = original_logprob
        self.cache: KVCache | None = self.new_cache()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_rid: dict[str, Request] = {}
        self.paused = False
        self._ops: deque[tuple[Callable[[], Awaitable[Any]], asyncio.Future[Any]]] = deque()
        self._wake = asyncio.Event()
        self._seeds = random.Random(seed)
        self.steps = 0
        self.tokens_generated = 0
        self.failed: BaseException | None = None
        self._stepped = asyncio.Condition()  # notified after every model step (health probes)
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-forward")

    def new_cache(self) -> KVCache:
        """An empty KV cache on the model's device, in its dtype."""
        return KVCache(self.cfg, self.model.device, self.model.dtype)

    def close(self) -> None:
        """Release the forward thread (after the loop task has ended)."""
        self._forward_thread.shutdown(wait=False, cancel_futures=True)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise EngineUnavailable(
                f"the engine's scheduler failed: {type(self.failed).__name__}: {self.failed}"
            )

    # ----- called from HTTP handlers (event loop thread) -----

    def new_generator(self, seed: int | None) -> torch.Generator:
        gen = torch.Generator()
        gen.manual_seed(seed if seed is not None else self._seeds.getrandbits(63))
        return gen

    def submit(self, req: Request) -> None:
        self._check_alive()
        if not self.model.loaded:
            raise EngineUnavailable("the weights are released; call /resume_memory_occupation first")
        if req.rid in self.by_rid:
            raise ValueError(f"rid={req.rid!r}: a request with this id is already running")
        self.by_rid[req.rid] = req
        self.waiting.append(req)
        self._wake.set()

    def abort(self, rid: str | None, abort_all: bool, message: str = "Abort requested by client") -> int:
        targets = list(self.by_rid.values()) if abort_all else [r for r in (self.by_rid.get(rid or ""),) if r]
        for req in targets:
            req.abort_message = message
        self._wake.set()
        return len(targets)

    async def between_steps(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op` on the scheduler task between two model steps and return its result."""
        self._check_alive()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._ops.append((op, future))
        self._wake.set()
        return await future

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    async def next_step(self) -> None:
        """Return once the model completes a step after this call (callers bound the wait)."""
        start = self.steps
        async with self._stepped:
            await self._stepped.wait_for(lambda: self.steps > start or self.failed is not None)
        self._check_alive()

    # ----- operations meant for between_steps -----

    def pause(self, mode: str) -> None:
        self.paused = True
        if mode == "abort":
            for req in [*self.running, *self.waiting]:
                req.abort_message = "Generation paused with mode abort"
            self.apply_aborts()
        elif mode == "retract":
            self.retract_all()

    def resume(self) -> None:
        self.paused = False

    def retract_all(self) -> None:
        """Free every running sequence's KV; it resumes later by re-reading prompt + output."""
        for req in reversed(self.running):
            self._free_slot(req)
            self.waiting.appendleft(req)
        self.running = []

    # ----- the loop -----

    async def run(self) -> None:
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._fail_all(e)
            raise

    def _fail_all(self, error: BaseException) -> None:
        """The loop is gone: end every request and queued operation now, naming the error."""
        self.failed = error
        message = f"the engine failed: {type(error).__name__}: {error}"
        for req in list(self.by_rid.values()):
            self._finish(req, {"type": "abort", "message": message})
        self.running, self.waiting = [], deque()
        while self._ops:
            _, future = self._ops.popleft()
            if not future.done():
                future.set_exception(EngineUnavailable(message))

    async def _loop(self) -> None:
        idle = True  # nothing ran since the loop last slept
        while True:
            while self._ops:
                op, future = self._ops.popleft()
                try:
                    result = await op()
                except Exception as e:  # the error belongs to the caller awaiting the op
                    if not future.done():
                        future.set_exception(e)
                else:
                    if not future.done():
                        future.set_result(result)
            self.apply_aborts()
            admit = self._admissible()
            if not admit and not (self.running and self._can_step()):
                idle = True
                await self._sleep_until_work()
                continue
            if idle and not self.running:
                # Work after a rest: one turn of the event loop first lets requests that arrived
                # together (a rollout's groups, each its own HTTP request) join the first prefill;
                # then everything is looked at again (operations, aborts, admission).
                idle = False
                await asyncio.sleep(0)
                continue
            idle = False
            await self._step(admit)

    def _can_step(self) -> bool:
        return not self.paused and self.model.loaded and self.cache is not None

    def _admissible(self) -> list[Request]:
        if not self._can_step():
            return []
        now = time.monotonic()
        room = self.max_running - len(self.running)
        admit: list[Request] = []
        for req in self.waiting:
            if len(admit) >= room:
                break
            if req.ready_at <= now:
                admit.append(req)
        return admit

    async def _sleep_until_work(self) -> None:
        self._wake.clear()
        timeout = None
        if self._can_step() and self.waiting:
            timeout = max(0.0, min(r.ready_at for r in self.waiting) - time.monotonic())
        try:
            async with asyncio.timeout(timeout):
                await self._wake.wait()
        except TimeoutError:
            pass

    def apply_aborts(self) -> None:
        for req in [r for r in self.running if r.abort_message is not None]:
            self.running.remove(req)
            self._finish(req, {"type": "abort", "message": req.abort_message})
        for req in [r for r in self.waiting if r.abort_message is not None]:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": req.abort_message})

    async def _step(self, admit: list[Request]) -> None:
        cache = self.cache
        assert cache is not None
        for req in admit:
            self.waiting.remove(req)
            need = min(len(req.prompt) + req.params.max_new_tokens + 1, self.context_length + 1)
            req.slot = cache.allocate(need)
        decoding = list(self.running)
        self.running.extend(admit)
        version = self.weight_version
        loop = asyncio.get_running_loop()
        choice, routes, scored = await loop.run_in_executor(
            self._forward_thread, self._forward, admit, decoding, cache
        )
        self.steps += 1
        for req, score in scored.items():
            req.prompt_score = score
        rows = [*admit, *decoding]
        for req, chunk in zip(rows, routes, strict=True):
            if chunk is None:
                continue
            if req in admit:
                req.routes = [chunk]  # a (re-)prefill covers every position so far
            else:
                req.routes.append(chunk)
        for req, tok, lp, top in zip(rows, choice.tokens, choice.logprobs, choice.top, strict=True):
            if req.params.max_new_tokens == 0:  # prompt scoring only: nothing is generated
                self.running.remove(req)
                self._finish(req, {"type": "length", "length": 0}, version)
                continue
            if top is not None:
                req.top_logprobs.append(top)
            self._append(req, tok, lp, version)
        async with self._stepped:
            self._stepped.notify_all()

    def _forward(
        self, admit: list[Request], decoding: list[Request], cache: KVCache
    ) -> tuple[Choice, list[torch.Tensor | None], dict[Request, PromptScore]]:
        """Worker thread: prefill the admitted prompts and advance the running ones, one batch;
        also each row's routed experts for the positions it forwarded (None unless asked), and
        the prompt log-probs of admitted rows that asked for them (once: not on a re-prefill)."""
        parts: list[torch.Tensor] = []
        routed: list[torch.Tensor | None] = []
        scored: dict[Request, PromptScore] = {}
        with torch.inference_mode():
            if admit:
                seqs = [r.prompt + r.output for r in admit]
                routes = self._routes_for(admit)
                score_from = {
                    row: r.logprob_start_len
                    for row, r in enumerate(admit)
                    if r.prompt_score is None
                    and wants_scoring(r.return_logprob, r.logprob_start_len, len(r.prompt))
                }
                logits_at: dict[int, torch.Tensor] = {}
                parts.append(
                    self.model.prefill(
                        seqs,
                        [r.slot for r in admit],  # type: ignore[misc]
                        cache,
                        routes,
                        score_from,
                        logits_at,
                    )
                )
                for row, start in score_from.items():
                    r = admit[row]
                    # A re-prefill also runs the output so far: keep the prompt's positions only.
                    at = logits_at[row][: len(r.prompt) - start]
                    scored[r] = score_prompt(r.prompt, start, at, r.top_logprobs_num)
                routed += [self._row_routes(routes, row, len(seq)) for row, seq in enumerate(seqs)]
            if decoding:
                routes = self._routes_for(decoding)
                parts.append(
                    self.model.decode(
                        [r.output[-1] for r in decoding],
                        [len(r.prompt) + len(r.output) - 1 for r in decoding],
                        [r.slot for r in decoding],  # type: ignore[misc]
                        cache,
                        routes,
                    )
                )
                routed += [self._row_routes(routes, row, 1) for row in range(len(decoding))]
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            rows = [*admit, *decoding]
            # Constrained rows learn which tokens may follow their output here, off the event loop.
            masks = [r.constraint.allowed(r.output) if r.constraint is not None else None for r in rows]
            choice = choose_tokens(
                logits,
                [r.params for r in rows],
                [r.generator for r in rows],
                self.original_logprob,
                masks=masks,
                top_logprobs=[r.top_logprobs_num for r in rows],
            )
            wanted = [r.return_routed_experts for r in rows]
            chunks = [chunk if want else None for chunk, want in zip(routed, wanted, strict=True)]
            return choice, chunks, scored

    def _routes_for(self, rows: list[Request]) -> Routes | None:
        """A capture for this forward when any of its rows returns routed experts."""
        return {} if any(r.return_routed_experts for r in rows) else None

    def _row_routes(self, routes: Routes | None, row: int, length: int) -> torch.Tensor | None:
        """Row `row`'s first `length` positions as [length, layers, top_k] int32; a dense layer's
        entries stay 0, as SGLang reports them."""
        if routes is None or self.cfg.moe is None:
            return None
        out = torch.zeros(length, self.cfg.layers, self.cfg.moe.top_k, dtype=torch.int32)
        for layer, ids in routes.items():
            out[:, layer] = ids[row, :length].to(torch.int32).cpu()
        return out

    def routed_experts(self, req: Request) -> torch.Tensor:
        """[prompt + completion - 1 - start, layers, top_k]: the experts of every forwarded token
        position from routed_experts_start_len on (the last output token is never forwarded)."""
        assert self.cfg.moe is not None
        seen = torch.cat(req.routes) if req.routes else torch.zeros(0, self.cfg.layers, self.cfg.moe.top_k)
        rows = max(0, len(req.prompt) + len(req.output) - 1)
        start = min(req.routed_experts_start_len, rows)
        return seen[start:rows].to(torch.int32).contiguous()

    def _append(self, req: Request, token: int, logprob: float, version: str) -> None:
        req.output.append(token)
        req.logprobs.append(logprob)
        self.tokens_generated += 1
        reason = self._finish_reason(req, token)
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason, version)
        else:
            req.progress.set()

    def _finish_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        p = req.params
        if len(req.output) >= p.min_new_tokens:
            if not p.ignore_eos and (token in self.cfg.eos_token_ids or token in (p.stop_token_ids or ())):
                return {"type": "stop", "matched": token}
            if p.stop_strings:
                text = self.tokenizer.decode(req.output, skip_special_tokens=p.skip_special_tokens)
                hits = [(text.find(s), s) for s in p.stop_strings if s in text]
                if hits:
                    at, matched = min(hits)
                    req.text_end = at if not p.no_stop_trim else at + len(matched)
                    return {"type": "stop", "matched": matched}
        if len(req.output) >= p.max_new_tokens or len(req.prompt) + len(req.output) >= self.context_length:
            return {"type": "length", "length": len(req.output)}
        return None

    def _free_slot(self, req: Request) -> None:
        if req.slot is not None and self.cache is not None:
            self.cache.release(req.slot)
        req.slot = None

    def _finish(self, req: Request, reason: dict[str, Any], version: str | None = None) -> None:
        self._free_slot(req)
        req.finish = reason
        req.weight_version = version if version is not None else self.weight_version
        self.by_rid.pop(req.rid, None)
        req.progress.set()
        req.done.set()

    def finish_now(self, req: Request) -> None:
        """Finish a request that needs no model step (max_new_tokens == 0)."""
        self._finish(req, {"type": "length", "length": 0})

    def _token_text(self, token: int) -> str:
        """One token's text, as SGLang's return_text_in_logprobs decodes it (special tokens kept)."""
        try:
            return self.tokenizer.decode([token], skip_special_tokens=False)
        except Exception:  # an id past the tokenizer's vocabulary (padded embeddings)
            return ""

    def output_text(self, req: Request) -> str:
        ids = req.output
        if req.finish and req.finish.get("type") == "stop" and isinstance(req.finish.get("matched"), int):
            ids = ids if req.params.no_stop_trim else ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
        return text[: req.text_end] if req.text_end is not None else text

    def response(self, req: Request) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "cached_tokens": 0,
            "weight_version": req.weight_version or self.weight_version,
            "e2e_latency": time.monotonic() - req.created,
        }
        if req.return_logprob:
            text = self._token_text if req.return_text_in_logprobs else _no_text
            score = req.prompt_score
            # SGLang always reports the prompt's entries beside the output's: [] unless scored.
            meta["input_token_logprobs"] = (
                [[lp, tok, text(tok)] for lp, tok in zip(score.logprobs, score.token_ids, strict=True)]
                if score is not None
                else []
            )
            meta["output_token_logprobs"] = [
                [lp, tok, text(tok)] for lp, tok in zip(req.logprobs, req.output, strict=True)
            ]
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = (
                    [None if row is None else [[lp, tok, text(tok)] for lp, tok in row] for row in score.top]
                    if score is not None and score.top is not None
                    else []
                )
                meta["output_top_logprobs"] = [
                    [[lp, tok, text(tok)] for lp, tok in row] for row in req.top_logprobs
                ]
        if req.return_routed_experts and req.finish is not None:
            # SGLang's encoding: base64 of the int32 array's bytes (slime decodes and reshapes it).
            meta["routed_experts"] = base64.b64encode(self.routed_experts(req).numpy().tobytes()).decode()
            # Where those rows start (slime reads it beside them to splice a partial answer).
            meta["routed_experts_start_len"] = req.routed_experts_start_len
        return {"text": self.output_text(req), "output_ids": list(req.output), "meta_info": meta}


def _no_text(token: int) -> None:
    return None


async def progress(reqs: list[Request]) -> AsyncIterator[tuple[int, Request]]:
    """(index, request) each time one of `reqs` has new tokens or has finished, until all have
    finished (what a streamed response sends)."""
    pending = dict(enumerate(reqs))
    sent = dict.fromkeys(pending, -1)
    while pending:
        waits = [asyncio.ensure_future(r.progress.wait()) for r in pending.values()]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        for i, req in list(pending.items()):
            if not req.progress.is_set():
                continue
            req.progress.clear()
            if len(req.output) == sent[i] and req.finish is None:
                continue
            sent[i] = len(req.output)
            yield i, req
            if req.finish is not None:
                del pending[i]
