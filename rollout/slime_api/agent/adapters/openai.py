"""`slime.agent.adapters.openai`: the OpenAI Chat Completions wire over the engine.

`POST /v1/chat/completions`, streamed (`stream: true`: one role chunk, then the reasoning, the
content and the tool calls each in one chunk, the finish chunk with usage, `[DONE]`) or not. The
session id is the agent's API key (`Authorization: Bearer <sid>`, where every OpenAI client puts
it), else `metadata.session_id` or `user` in the body. `tool_choice` "required" or a named
function is enforced (see `adapters.common`); the Responses API is not served.

Echo matching: the trajectory matches history by dict equality, so messages are translated to a
canonical shape: tool-call arguments as dicts, wire ids (tool_call_id, tool_calls[].id) dropped,
`developer` read as `system`; a reply with tool calls carries content null on the wire and empty
text in the trajectory, and only its first call, because some clients drop the rest on echo.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from tether.rollout.slime_api.agent.adapters.common import (
    BaseAdapter,
    ForcedTools,
    Reply,
    flatten_content,
    manager_finish_reason,
    sid_from_bearer,
    sid_from_body,
    tool_call_dict,
)
from tether.rollout.slime_api.agent.parsing import ParsedModelOutput

logger = logging.getLogger(__name__)

MODEL_LABEL = "slime-actor"


class OpenAIAdapter(BaseAdapter):
    """An OpenAI-compatible `/v1/chat/completions` server recording each session's trajectory."""

    logger = logger
    log_prefix = "openai_adapter"
    max_token_keys = ("max_completion_tokens", "max_tokens", "max_output_tokens")
    stop_keys = ("stop",)

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._run_turn)

    def _session_id(self, request: web.Request, body: dict[str, Any]) -> str:
        return sid_from_bearer(request) or sid_from_body(body) or "default"

    def _translate(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        messages = body.get("messages") or []
        if not isinstance(messages, list):
            raise web.HTTPBadRequest(text=f"messages: must be a list, not {type(messages).__name__}")
        return _translate_messages(messages), _tools_to_chat_tools(body.get("tools"))

    def _forced_tools(self, body: dict[str, Any]) -> ForcedTools | None:
        choice = body.get("tool_choice")
        parallel = body.get("parallel_tool_calls") is not False
        if choice == "required":
            return ForcedTools(None, parallel)
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = (choice.get("function") or {}).get("name")
            if not name:
                raise web.HTTPBadRequest(text=f"tool_choice={choice!r}: names no function")
            return ForcedTools((str(name),), parallel)
        return None

    def _build_reply(
        self,
        parsed: ParsedModelOutput,
        raw_finish: str,
        translated: list[dict[str, Any]],
        tools_schema: list[dict[str, Any]] | None,
    ) -> Reply:
        wire_message, manager_message, wire_finish = _build_reply_parts(parsed, raw_finish)
        return Reply(
            manager_message=manager_message,
            finish_reason=manager_finish_reason(parsed.tool_uses, raw_finish),
            wire=(wire_message, wire_finish),
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
        wire_message, wire_finish = reply.wire
        if stream:
            return await _render_stream(request, body, wire_message, wire_finish, in_tok, out_tok)
        return web.json_response(_render_response(body, wire_message, wire_finish, in_tok, out_tok))


def _arguments_as_dict(arguments: Any) -> dict[str, Any]:
    """Wire arguments (a JSON string) as a dict; anything unreadable kept under `_raw_arguments`."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    text = arguments.strip() if isinstance(arguments, str) else str(arguments)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"_raw_arguments": arguments if isinstance(arguments, str) else text}
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def _translate_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """OpenAI messages as chat-template messages in the canonical shape (module docstring)."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = "system" if msg.get("role") == "developer" else msg.get("role")
        content = msg.get("content")
        if role in {"system", "user", "tool"}:
            out.append({"role": role, "content": flatten_content(content)})
        elif role == "assistant":
            assistant: dict[str, Any] = {"role": "assistant", "content": flatten_content(content)}
            if msg.get("reasoning_content"):
                assistant["reasoning_content"] = msg["reasoning_content"]
            calls = []
            for call in msg.get("tool_calls") or []:
                if not isinstance(call, dict):
                    continue
                fn = call.get("function") or {}
                arguments = fn.get("arguments")
                if arguments is None:
                    arguments = call.get("arguments", {})
                calls.append(
                    tool_call_dict(
                        fn.get("name") or call.get("name") or "tool", _arguments_as_dict(arguments)
                    )
                )
            if calls:
                assistant["tool_calls"] = calls
            out.append(assistant)
    return out


def _tools_to_chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Declared function tools in the chat template's shape (flat `{name, ...}` tools accepted too)."""
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            continue
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        if not fn.get("name"):
            continue
        out.append(
            {
                "type": "function",
                "function": {
                    "name": fn["name"],
                    "description": fn.get("description", ""),
                    "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
                },
            }
        )
    return out or None


def _build_reply_parts(parsed: ParsedModelOutput, finish: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(wire message, trajectory message, wire finish reason)."""
    wire_calls = []
    kept_calls = []
    for use in parsed.tool_uses:
        args = use.get("input") or {}
        if not isinstance(args, dict):
            args = {"_raw_arguments": str(args)}
        name = use.get("name", "tool")
        wire_calls.append(
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False, sort_keys=True)},
            }
        )
        kept_calls.append(tool_call_dict(name, args))
    wire: dict[str, Any] = {"role": "assistant", "content": None if wire_calls else (parsed.text or None)}
    kept: dict[str, Any] = {"role": "assistant", "content": "" if wire_calls else (parsed.text or "")}
    if parsed.reasoning:
        wire["reasoning_content"] = parsed.reasoning  # not kept: clients drop it on echo
    if wire_calls:
        wire["tool_calls"] = wire_calls[:1]
        kept["tool_calls"] = kept_calls[:1]
    wire_finish = "tool_calls" if parsed.tool_uses else ("length" if finish == "length" else "stop")
    return wire, kept, wire_finish


def _usage(in_tok: int, out_tok: int) -> dict[str, int]:
    return {"prompt_tokens": in_tok, "completion_tokens": out_tok, "total_tokens": in_tok + out_tok}


def _render_response(
    body: dict[str, Any], wire_message: dict[str, Any], wire_finish: str, in_tok: int, out_tok: int
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl_{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", MODEL_LABEL),
        "choices": [{"index": 0, "message": wire_message, "finish_reason": wire_finish}],
        "usage": _usage(in_tok, out_tok),
    }


async def _render_stream(
    request: web.Request,
    body: dict[str, Any],
    wire_message: dict[str, Any],
    wire_finish: str,
    in_tok: int,
    out_tok: int,
) -> web.StreamResponse:
    """The whole turn as Chat Completions chunks (the turn is complete before the first is sent)."""
    out = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "Connection": "keep-alive",
        },
    )
    await out.prepare(request)
    cid, created = f"chatcmpl_{secrets.token_hex(12)}", int(time.time())

    async def emit(
        delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None
    ) -> None:
        chunk: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.get("model", MODEL_LABEL),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage is not None:
            chunk["usage"] = usage
        await out.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

    await emit({"role": "assistant"})
    if wire_message.get("reasoning_content"):
        await emit({"reasoning_content": wire_message["reasoning_content"]})
    if wire_message.get("content"):
        await emit({"content": wire_message["content"]})
    calls = wire_message.get("tool_calls") or []
    if calls:
        # All calls in one chunk: clients that merge argument fragments by index would glue
        # separate calls together otherwise.
        await emit({"tool_calls": [{**call, "index": i} for i, call in enumerate(calls)]})
    await emit({}, wire_finish, _usage(in_tok, out_tok))
    await out.write(b"data: [DONE]\n\n")
    return out


__all__ = ["OpenAIAdapter"]
