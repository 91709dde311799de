"""--rollout-function-path tether.rollout.hooks.rollout_buffer.generate_rollout: each rollout's
trajectories taken from slime's external rollout buffer (slime_plugins/rollout_buffer/buffer.py),
spoken to as slime's rollout_buffer_example.py speaks to it.

The buffer runs agent generators of its own against tether's router front (`args.sglang_router_ip`
and `args.sglang_router_port`) and holds the trajectories they write. Over HTTP (`--rollout-buffer-url`):

* `POST /start_rollout` once per run, before the first rollout: the job's settings, with slime's
  keys and string-typed values (`task_type` is --rollout-task-type, `input_file` --prompt-data,
  `num_repeat_per_sample` --n-samples-per-prompt, `remote_engine_url` the router front, ...).
* `POST /get_rollout_data` with `{}` until the batch is in: the answer is `{"success": bool, "data":
  {"data": [trajectory, ...], "meta_info": {...}}}` (or `data` a bare list); `success` false means
  nothing is ready yet. A trajectory is `{"uid", "instance_id", "messages", "reward", "extra_info"}`;
  the trajectories of one `instance_id` are one group.

A rollout takes --rollout-batch-size groups; past that the newest (by `timestamp`) are kept, as slime
keeps them. When the buffer has nothing ready and at least --min-batch-collection-ratio of the batch
is in, the rollout trains on the shorter batch. A failed request (connection, timeout, HTTP error,
a body that is not JSON) is retried after POLL_SECONDS, up to --fetch-trajectory-retry-times failures
per rollout (-1: without limit); then the rollout fails unless the ratio is met. A trajectory that is
malformed fails the rollout at once, naming the trajectory, the field and its value.

Each trajectory becomes one Sample as slime's example makes it: the messages rendered with the chat
template into tokens and a loss mask on the assistant's tokens (slime's MultiTurnLossMaskGenerator
with --loss-mask-type), the response from the first trained token on, `reward` as sent, TRUNCATED
when `extra_info["finish_reason"]` is "length" (else COMPLETED), `prompt` the uid and `metadata` the
extra_info (plus `instance_id` and `uid`). The buffer sends no engine log-probs, so
`rollout_log_probs` are zeros and --use-rollout-logprobs / --use-tis are refused with this function.
Prompts come from the buffer (it reads --prompt-data itself): tether's data source is not drawn from.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tether.rollout.config import BUFFER_ROLLOUT
from tether.rollout.data.source import DataSource
from tether.rollout.evaluation import run_evaluation
from tether.rollout.hooks.calls import HookError
from tether.rollout.http_proxy import proxy_for
from tether.rollout.rollout_fn import RolloutContext, current_context, rollout_metrics
from tether.rollout.sample import Sample, SampleContractError, SampleStatus, validate_group, validate_sample

log = logging.getLogger(__name__)

POLL_SECONDS = 3.0
"""Wait before asking the buffer again, after it had nothing ready or a request failed (slime's 3 s)."""
REQUEST_TIMEOUT_SECONDS = 120.0
"""Limit on one request to the buffer (slime's)."""
WAIT_LOG_SECONDS = 30.0
"""How often a rollout waiting on an empty buffer says so."""
REQUIRED_KEYS = ("uid", "instance_id", "messages", "reward", "extra_info")
"""What every trajectory carries (slime's example refuses one without them)."""

_STATE_KEY = __name__


class RolloutBufferError(HookError):
    """The rollout buffer could not be reached, or sent something that breaks the protocol."""

    def __init__(self, reason: str, *, field: str | None = None) -> None:
        super().__init__(BUFFER_ROLLOUT, reason, field=field)


class _RequestFailed(Exception):
    """A request to the buffer failed in a way worth retrying."""


@dataclass
class _BufferState:
    """Per rollout context: the HTTP session, whether the buffer was started, the groups it finished."""

    session: aiohttp.ClientSession
    started: bool = False
    finished_groups: list[Any] = field(default_factory=list)


@dataclass
class Collected:
    """What one rollout took from the buffer."""

    groups: list[list[dict[str, Any]]]
    """The trajectories kept, one list per instance_id, oldest group first."""
    meta_infos: list[dict[str, Any]]
    failed_requests: int
    dropped_groups: int
    """Groups past the batch that were left out (the oldest), as slime leaves them."""


async def generate_rollout(
    args: Any, rollout_id: int, data_source: DataSource, evaluation: bool = False
) -> list[list[Sample]] | dict[str, float]:
    """One rollout's groups from the rollout buffer (module docstring); evaluation is tether's own,
    on its engines, as the default rollout's."""
    ctx = current_context()
    if evaluation:
        return await run_evaluation(ctx, rollout_id)
    began = time.monotonic()
    state = await _state(ctx)
    if not state.started:
        await start_rollout(state.session, args, skip_instance_ids=state.finished_groups)
        state.started = True
    collected = await collect_batch(state.session, args)
    for meta in collected.meta_infos:
        finished = meta.get("finished_groups")
        if isinstance(finished, list):
            state.finished_groups.extend(finished)
    if ctx.tokenizer is None:
        raise RolloutBufferError(
            "needs --hf-checkpoint: its tokenizer turns the trajectories' messages into tokens"
        )
    groups = to_groups(collected.groups, ctx.tokenizer, args.loss_mask_type, rollout_id)
    cfg = ctx.rollout
    metrics = rollout_metrics(groups, cfg.reward_key, time.monotonic() - began, log_passrate=cfg.log_passrate)
    metrics["rollout/buffer/collected_ratio"] = len(groups) / args.rollout_batch_size
    metrics["rollout/buffer/failed_requests"] = float(collected.failed_requests)
    metrics["rollout/buffer/dropped_groups"] = float(collected.dropped_groups)
    metrics.update(unfiltered_metrics(collected.meta_infos))
    ctx.metrics = metrics
    return groups


async def _state(ctx: RolloutContext) -> _BufferState:
    state = ctx.extensions.get(_STATE_KEY)
    if state is None:
        state = _BufferState(session=aiohttp.ClientSession())
        ctx.resources.push_async_callback(state.session.close)
        ctx.extensions[_STATE_KEY] = state
    return state


# ----- the protocol -----
def start_payload(args: Any, skip_instance_ids: list[Any]) -> dict[str, Any]:
    """What `/start_rollout` receives: slime's keys, and its strings where it sends strings."""
    max_tokens = args.rollout_max_response_len
    return {
        "num_process": str(getattr(args, "rollout_num_process", 100)),  # a --custom-config-path key
        "num_epoch": str(args.num_epoch or 3),
        "remote_engine_url": f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        "remote_buffer_url": args.rollout_buffer_url,
        "task_type": args.rollout_task_type,
        "input_file": args.prompt_data,
        "num_repeat_per_sample": str(args.n_samples_per_prompt),
        "max_tokens": str(max_tokens),
        "sampling_params": {
            "max_tokens": max_tokens,
            "temperature": args.rollout_temperature,
            "top_p": args.rollout_top_p,
        },
        "tokenizer_path": args.hf_checkpoint,
        "skip_instance_ids": list(skip_instance_ids),
    }


async def start_rollout(session: aiohttp.ClientSession, args: Any, *, skip_instance_ids: list[Any]) -> Any:
    """Start the buffer's generators; retried as fetches are (--fetch-trajectory-retry-times)."""
    url = f"{_base(args)}/start_rollout"
    payload = start_payload(args, skip_instance_ids)
    failures = 0
    while True:
        try:
            answer = await _post(session, url, payload, args)
        except _RequestFailed as exc:
            failures += 1
            _give_up_after(args, failures, url, exc)
            await asyncio.sleep(POLL_SECONDS)
            continue
        log.info("rollout buffer %s started (task type %r): %s", url, args.rollout_task_type, answer)
        return answer


async def collect_batch(session: aiohttp.ClientSession, args: Any) -> Collected:
    """Trajectories from `/get_rollout_data` until the batch is in (module docstring)."""
    url = f"{_base(args)}/get_rollout_data"
    target = args.rollout_batch_size
    least = max(1, math.ceil(args.min_batch_collection_ratio * target - 1e-9))
    by_instance: dict[str | int, list[dict[str, Any]]] = {}
    meta_infos: list[dict[str, Any]] = []
    failures = fetches = 0
    waiting_since = time.monotonic()
    while len(by_instance) < target:
        try:
            answer = await _post(session, url, {}, args)
        except _RequestFailed as exc:
            failures += 1
            if len(by_instance) >= least and _exhausted(args, failures):
                break
            _give_up_after(args, failures, url, exc, have=len(by_instance), least=least)
            await asyncio.sleep(POLL_SECONDS)
            continue
        fetches += 1
        records, meta = parse_answer(answer, fetch=fetches)
        if meta:
            meta_infos.append(meta)
        if not records:
            if len(by_instance) >= least:
                break  # nothing more at hand, and enough of the batch is in
            if time.monotonic() - waiting_since > WAIT_LOG_SECONDS:
                log.info(
                    "rollout buffer %s: %d of %d groups in, waiting for more", url, len(by_instance), target
                )
                waiting_since = time.monotonic()
            await asyncio.sleep(POLL_SECONDS)
            continue
        for pos, record in enumerate(records):
            check_trajectory(record, f"fetch {fetches} trajectory {pos}")
            by_instance.setdefault(record["instance_id"], []).append(record)
    groups = list(by_instance.values())
    dropped = max(0, len(groups) - target)
    if dropped:
        # slime keeps the newest groups (latest timestamp in the group) and drops the rest
        newest = sorted(range(len(groups)), key=lambda i: _group_time(groups[i]), reverse=True)[:target]
        groups = [groups[i] for i in sorted(newest)]
    return Collected(groups=groups, meta_infos=meta_infos, failed_requests=failures, dropped_groups=dropped)


def parse_answer(answer: Any, *, fetch: int) -> tuple[list[Any], dict[str, Any]]:
    """The trajectories and meta info of one `/get_rollout_data` answer; nothing when not ready."""
    where = f"/get_rollout_data answer {fetch}"
    if not isinstance(answer, Mapping):
        raise RolloutBufferError(f"{where} is {_short(answer)}, not a JSON object", field="success")
    success = answer.get("success")
    if not isinstance(success, bool):
        raise RolloutBufferError(f"{where}: success={_short(success)} must be true or false", field="success")
    if not success:
        return [], {}
    data = answer.get("data")
    meta: Any = {}
    if isinstance(data, Mapping):
        meta = data.get("meta_info") or {}
        data = data.get("data")
    if not isinstance(data, list):
        raise RolloutBufferError(f"{where}: data={_short(data)} must be a list of trajectories", field="data")
    if data and isinstance(data[0], Mapping) and "data" in data[0]:
        data = [
            item["data"] if isinstance(item, Mapping) else item for item in data
        ]  # older buffers wrap them
    if not isinstance(meta, Mapping):
        raise RolloutBufferError(f"{where}: meta_info={_short(meta)} must be an object", field="meta_info")
    return data, dict(meta)


def check_trajectory(record: Any, where: str) -> None:
    """The keys and kinds every trajectory must have; raises RolloutBufferError naming the field."""
    if not isinstance(record, Mapping):
        raise RolloutBufferError(f"{where} is {_short(record)}, not a JSON object", field="trajectory")
    label = f"{where} (uid={_short(record.get('uid'))})"
    for key in REQUIRED_KEYS:
        if key not in record:
            raise RolloutBufferError(
                f"{label} has no {key!r} (it needs {', '.join(REQUIRED_KEYS)})", field=key
            )
    instance = record["instance_id"]
    if isinstance(instance, bool) or not isinstance(instance, str | int):
        raise RolloutBufferError(
            f"{label}: instance_id={_short(instance)} must be a string or an integer", field="instance_id"
        )
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise RolloutBufferError(
            f"{label}: messages={_short(messages)} must be a non-empty list of chat messages",
            field="messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RolloutBufferError(
                f"{label}: messages[{i}]={_short(message)} must be an object with a string 'role'",
                field=f"messages[{i}]",
            )
    reward = record["reward"]
    if isinstance(reward, Mapping):
        bad = {k: v for k, v in reward.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad:
            raise RolloutBufferError(
                f"{label}: reward={_short(reward)} holds non-finite values", field="reward"
            )
    elif isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise RolloutBufferError(
            f"{label}: reward={_short(reward)} must be a finite number (or an object of them)", field="reward"
        )
    if not isinstance(record["extra_info"], Mapping):
        raise RolloutBufferError(
            f"{label}: extra_info={_short(record['extra_info'])} must be an object", field="extra_info"
        )


# ----- trajectories as Samples -----
def to_groups(
    groups: list[list[dict[str, Any]]], tokenizer: Any, loss_mask_type: str, rollout_id: int
) -> list[list[Sample]]:
    """tether's checked groups for the collected trajectories (indexes numbered in order)."""
    render = _loss_mask_generator(tokenizer, loss_mask_type)
    out: list[list[Sample]] = []
    index = 0
    for g, records in enumerate(groups):
        group = []
        for record in records:
            group.append(trajectory_sample(record, render, index=index, group_index=g, rollout_id=rollout_id))
            index += 1
        try:
            validate_group(group, len(group))
        except SampleContractError as exc:
            raise RolloutBufferError(
                f"the trajectories of instance_id={_short(records[0]['instance_id'])}: {exc}", field=exc.field
            ) from exc
        out.append(group)
    return out


def trajectory_sample(
    record: dict[str, Any], render: Any, *, index: int, group_index: int, rollout_id: int
) -> Sample:
    """One trajectory as a Sample, as slime's example makes it (module docstring)."""
    label = f"trajectory uid={_short(record['uid'])} (instance_id={_short(record['instance_id'])})"
    try:
        tokens, mask = render.get_loss_mask(record["messages"])
    except (ValueError, TypeError, KeyError) as exc:
        raise RolloutBufferError(f"{label}: messages cannot be rendered: {exc}", field="messages") from exc
    response_length = render.get_response_lengths([mask])[0]
    if response_length == 0:
        raise RolloutBufferError(
            f"{label}: messages={_short(record['messages'])} hold no assistant token to train on",
            field="messages",
        )
    extra = dict(record["extra_info"])
    reward = record["reward"]
    sample = Sample(
        index=index,
        group_index=group_index,
        rollout_id=rollout_id,
        prompt=str(record["uid"]),
        tokens=list(tokens),
        response_length=response_length,
        reward=dict(reward) if isinstance(reward, Mapping) else float(reward),
        loss_mask=list(mask[-response_length:]),
        rollout_log_probs=[0.0] * response_length,
        status=SampleStatus.TRUNCATED if extra.get("finish_reason") == "length" else SampleStatus.COMPLETED,
        metadata={**extra, "instance_id": record["instance_id"], "uid": record["uid"]},
    )
    try:
        validate_sample(sample)
    except SampleContractError as exc:
        raise RolloutBufferError(f"{label}: {exc}", field=exc.field) from exc
    return sample


def _loss_mask_generator(tokenizer: Any, loss_mask_type: str) -> Any:
    # Imported here: a module-level name from tether's slime API would make tether take this
    # function for one written against slime's API (convert.uses_slime_api).
    from tether.rollout.slime_api.utils.mask_utils import MultiTurnLossMaskGenerator

    return MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=loss_mask_type)


def unfiltered_metrics(meta_infos: list[dict[str, Any]]) -> dict[str, float]:
    """slime's `rollout/no_filter/*`: every trajectory the buffer saw, before its group filter."""
    counted = [m for m in meta_infos if _number(m.get("total_samples"))]
    total = sum(float(m["total_samples"]) for m in counted)
    if total <= 0:
        return {}
    out = {"rollout/no_filter/total_samples": total}
    rewarded = [m for m in counted if _number(m.get("avg_reward"))]
    if rewarded:
        out["rollout/no_filter/avg_reward"] = (
            sum(float(m["avg_reward"]) * float(m["total_samples"]) for m in rewarded) / total
        )
    return out


# ----- helpers -----
async def _post(session: aiohttp.ClientSession, url: str, payload: Any, args: Any) -> Any:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    proxy = proxy_for(url, getattr(args, "http_proxy", None))  # --http-proxy, for a buffer elsewhere
    try:
        async with session.post(url, json=payload, timeout=timeout, proxy=proxy) as response:
            if response.status >= 400:
                text = await response.text()
                raise _RequestFailed(f"HTTP {response.status}: {text[:200]}")
            try:
                return await response.json(content_type=None)
            except ValueError as exc:
                raise _RequestFailed(f"the answer is not JSON ({exc})") from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _RequestFailed(f"{type(exc).__name__}: {exc}") from exc


def _exhausted(args: Any, failures: int) -> bool:
    limit = args.fetch_trajectory_retry_times
    return limit != -1 and failures >= limit


def _give_up_after(
    args: Any, failures: int, url: str, exc: Exception, *, have: int | None = None, least: int | None = None
) -> None:
    """Raise once --fetch-trajectory-retry-times failures are spent; otherwise say a retry is coming."""
    if not _exhausted(args, failures):
        log.warning("rollout buffer %s failed (%s); retrying (failure %d)", url, exc, failures)
        return
    got = "" if have is None else f", with {have} of the {least} groups --min-batch-collection-ratio needs"
    raise RolloutBufferError(
        f"POST {url} failed {failures} times (--fetch-trajectory-retry-times="
        f"{args.fetch_trajectory_retry_times}){got}; last error: {exc}"
    ) from exc


def _base(args: Any) -> str:
    url = args.rollout_buffer_url
    if not url:
        raise RolloutBufferError("needs --rollout-buffer-url")
    return str(url).rstrip("/")


def _group_time(records: list[dict[str, Any]]) -> float:
    """A group's time, slime's way: the latest `timestamp` of its trajectories (or their
    extra_info's), 0 when none has one."""
    times = []
    for record in records:
        for holder in (record, record.get("extra_info") or {}):
            if "timestamp" in holder:
                try:
                    times.append(float(holder["timestamp"]))
                except (TypeError, ValueError):
                    raise RolloutBufferError(
                        f"trajectory uid={_short(record.get('uid'))}: timestamp={_short(holder['timestamp'])} "
                        "is not a number",
                        field="timestamp",
                    ) from None
                break
    return max(times) if times else 0.0


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
