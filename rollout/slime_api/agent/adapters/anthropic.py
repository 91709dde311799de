"""`slime.agent.adapters.anthropic`: the Anthropic Messages wire over the engine.

`POST /v1/messages`, streamed (`message_start`, then `content_block_start` / one `_delta` /
`content_block_stop` per block, `message_delta` with the stop reason and usage, `message_stop`)
or not, and `POST /v1/messages/count_tokens` (the rendered prompt's length). The session id is
the agent's key: `Authorization: Bearer <sid>` (Claude Code's ANTHROPIC_AUTH_TOKEN), else
`X-Api-Key` (the SDK's api_key). `tool_choice` `{"type": "any"}` or `{"type": "tool", "name"}` is
enforced (see `adapters.common`).

Translation: `system` becomes the first system message; a user message's `tool_result` blocks
become tool messages and its text blocks user messages; an assistant message's text, thinking and
`tool_use` blocks become one assistant message (tool-use ids dropped, inputs kept as dicts, so the
echo of a turn equals the recorded one). A system message in the middle of the list, which many
chat templates refuse, is folded into the nearest user message as a `<system-reminder>` block.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from aiohttp import web

from tether.rollout.slime_api.agent.adapters.common import (
    BaseAdapter,
    ForcedTools,
    Reply,
    _render_token_ids,
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    tool_call_dict,
)
from tether.rollout.slime_api.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)

MODEL_LABEL = "slime-actor"
_REMINDER_OPEN, _REMINDER_CLOSE = "<system-reminder>\n", "\n</system-reminder>\n"


class AnthropicAdapter(BaseAdapter):
    """An Anthropic-compatible `/v1/messages` server recording each session's trajectory."""

    logger = logger
    log_prefix = "anthropic_adapter"
    max_token_keys = ("max_tokens",)
    stop_keys = ("stop_sequences",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._run_turn)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)

    def _session_id(self, request: web.Request, body: dict[str, Any]) -> str:
        return sid_from_bearer(request) or (request.headers.get("X-Api-Key") or "").strip() or "default"

    def _preprocess_body(self, body: dict[str, Any]) -> None:
        _fold_mid_list_system_into_user(body)

    def _translate(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise web.HTTPBadRequest(text=f"messages: must be a list, not {type(messages).__name__}")
        return _translate_messages(messages, body.get("system")), _tools_to_chat_tools(body.get("tools"))

    def _forced_tools(self, body: dict[str, Any]) -> ForcedTools | None:
        choice = body.get("tool_choice")
        if not isinstance(choice, dict):
            return None
        parallel = not choice.get("disable_parallel_tool_use", False)
        if choice.get("type") == "any":
            return ForcedTools(None, parallel)
        if choice.get("type") == "tool":
            if not choice.get("name"):
                raise web.HTTPBadRequest(text=f"tool_choice={choice!r}: names no tool")
            return ForcedTools((str(choice["name"]),), parallel)
        return None

    def _build_reply(
        self,
        parsed: ParsedModelOutput,
        raw_finish: str,
        translated: list[dict[str, Any]],
        tools_schema: list[dict[str, Any]] | None,
    ) -> Reply:
        blocks, stop_reason, manager_message = _build_reply_parts(parsed, raw_finish)
        return Reply(
            manager_message=manager_message,
            finish_reason=manager_finish_reason(parsed.tool_uses, raw_finish),
            wire=(blocks, stop_reason),
        )

    async def _respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        reply: Reply,
        in_tok: int,
        out_tok: int,
        stream: bool,
    ) -> web.StreamResponse:
        blocks, stop_reason = reply.wire
        if stream:
            return await _render_stream(request, body, blocks, stop_reason, in_tok, out_tok)
        return web.json_response(_render_response(body, blocks, stop_reason, in_tok, out_tok))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="body: must be a JSON object")
        _fold_mid_list_system_into_user(body)
        messages, tools = self._translate(body)
        return web.json_response(
            {"input_tokens": len(_render_token_ids(messages, self.tokenizer, tools=tools))}
        )


def _translate_messages(messages: list[Any], system: Any) -> list[dict[str, Any]]:
    """Anthropic messages (and `system`) as chat-template messages (module docstring)."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": flatten_content(system)})
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role, content = msg.get("role"), msg.get("content")
        blocks: list[Any] = (
            content if isinstance(content, list) else [{"type": "text", "text": flatten_content(content)}]
        )
        if role == "user":
            for block in blocks:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind == "tool_result":
                    out.append({"role": "tool", "content": flatten_content(block.get("content"))})
                elif kind == "text":
                    out.append({"role": "user", "content": block.get("text", "")})
                else:
                    out.append({"role": "user", "content": flatten_content([block])})
        elif role == "assistant":
            texts, thoughts, calls = [], [], []
            for block in blocks:
                if not isinstance(block, dict):
                    continue
                if block.get("type") == "text":
                    texts.append(block.get("text", ""))
                elif block.get("type") == "thinking":
                    thoughts.append(block.get("thinking", ""))
                elif block.get("type") == "tool_use":
                    calls.append(tool_call_dict(block.get("name", "tool"), block.get("input")))
            assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thoughts:
                assistant["reasoning_content"] = "".join(thoughts)
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
        elif role == "system":
            out.append({"role": "system", "content": flatten_content(content)})
    return out


def _tools_to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools (`name`, `description`, `input_schema`) in the chat template's shape."""
    if not tools:
        return None
    out = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema")
                or t.get("parameters")
                or {"type": "object", "properties": {}},
            },
        }
        for t in tools
        if isinstance(t, dict) and "name" in t
    ]
    return out or None


def _build_reply_parts(
    parsed: ParsedModelOutput, finish: str
) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """(content blocks, stop reason, trajectory message)."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning})
    if parsed.text:
        blocks.append({"type": "text", "text": parsed.text})
    calls = []
    for use in parsed.tool_uses:
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{secrets.token_hex(8)}",
                "name": use["name"],
                "input": use["input"],
            }
        )
        calls.append(tool_call_dict(use["name"], use.get("input")))
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    stop = "tool_use" if parsed.tool_uses else ("max_tokens" if finish == "length" else "end_turn")
    kept: dict[str, Any] = {"role": "assistant", "content": parsed.text or ""}
    if parsed.reasoning:
        kept["reasoning_content"] = parsed.reasoning
    if calls:
        kept["tool_calls"] = calls
    return blocks, stop, kept


def _render_response(
    body: dict[str, Any], blocks: list[dict[str, Any]], stop_reason: str, in_tok: int, out_tok: int
) -> dict[str, Any]:
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", MODEL_LABEL),
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": in_tok, "output_tokens": out_tok},
    }


async def _render_stream(
    request: web.Request,
    body: dict[str, Any],
    blocks: list[dict[str, Any]],
    stop_reason: str,
    in_tok: int,
    out_tok: int,
) -> web.StreamResponse:
    """The whole turn as Messages stream events (the turn is complete before the first is sent)."""
    out = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
        },
    )
    await out.prepare(request)

    async def event(name: str, data: dict[str, Any]) -> None:
        await out.write(f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

    start = _render_response(body, [], "", in_tok, 0)
    start["stop_reason"] = None
    await event("message_start", {"type": "message_start", "message": start})
    for i, block in enumerate(blocks):
        if block["type"] == "thinking":
            opened: dict[str, Any] = {"type": "thinking", "thinking": ""}
            delta: dict[str, Any] = {"type": "thinking_delta", "thinking": block["thinking"]}
        elif block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
        await event(
            "content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}
        )
        await event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
        await event("content_block_stop", {"type": "content_block_stop", "index": i})
    await event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"input_tokens": in_tok, "output_tokens": out_tok},
        },
    )
    await event("message_stop", {"type": "message_stop"})
    return out


def _fold_mid_list_system_into_user(body: dict[str, Any]) -> bool:
    """Fold every system message after the first position into the nearest user message (the one
    before it, else the one after, else a new user message) as a `<system-reminder>` text block.
    Changes `body` in place; answers whether anything was folded."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    late = [i for i, m in enumerate(messages) if i > 0 and isinstance(m, dict) and m.get("role") == "system"]
    if not late:
        return False

    def blocks_of(msg: dict[str, Any]) -> list[Any]:
        if not isinstance(msg.get("content"), list):
            text = msg.get("content")
            msg["content"] = [{"type": "text", "text": text if isinstance(text, str) else ""}]
        return msg["content"]  # type: ignore[no-any-return]

    folded: set[int] = set()
    for i in late:
        reminder = {
            "type": "text",
            "text": _REMINDER_OPEN + flatten_content(messages[i].get("content")) + _REMINDER_CLOSE,
        }
        before = [
            j
            for j in range(i - 1, -1, -1)
            if isinstance(messages[j], dict) and messages[j].get("role") == "user"
        ]
        after = [
            j
            for j in range(i + 1, len(messages))
            if isinstance(messages[j], dict) and messages[j].get("role") == "user"
        ]
        if before:
            blocks_of(messages[before[0]]).append(reminder)
            folded.add(i)
        elif after:
            blocks_of(messages[after[0]]).insert(0, reminder)
            folded.add(i)
        else:
            messages[i] = {"role": "user", "content": [reminder]}
    body["messages"] = [m for k, m in enumerate(messages) if k not in folded]
    return True


__all__ = ["AnthropicAdapter"]
