#!/usr/bin/env python3
"""A scripted stand-in for the `claude` CLI, installed into a sandbox as an npm package the way
slime's ClaudeCodeHarness installs Claude Code. It speaks the Anthropic Messages API to
$ANTHROPIC_BASE_URL with $ANTHROPIC_AUTH_TOKEN (the session id), as Claude Code does: it offers
the model one `write_file` tool whose arguments the schema pins to the fix (so the tiny test model,
made to call the tool, writes exactly it), runs the call in its working directory, sends the tool
result back, lets the model answer, and prints stream-json lines. Standard library only."""

from __future__ import annotations

import json
import os
import sys
import urllib.request

FIXED = "def add(a, b):\n    return a + b\n"
WRITE_FILE = {
    "name": "write_file",
    "description": "Replace a file's contents.",
    "input_schema": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "enum": ["calc.py"]},
            "content": {"type": "string", "enum": [FIXED]},
        },
        "required": ["path", "content"],
    },
}


def ask(messages: list[dict], **extra: object) -> dict:
    body = {"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 512, "messages": messages, **extra}
    request = urllib.request.Request(
        os.environ["ANTHROPIC_BASE_URL"].rstrip("/") + "/v1/messages",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"],
            "anthropic-version": "2023-06-01",
        },
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


def main() -> int:
    if "--version" in sys.argv:
        print("0.0.1 (fake claude for tests)")
        return 0
    prompt = sys.argv[sys.argv.index("-p") + 1]
    messages: list[dict] = [{"role": "user", "content": prompt}]
    first = ask(
        messages,
        tools=[WRITE_FILE],
        tool_choice={"type": "tool", "name": "write_file", "disable_parallel_tool_use": True},
    )
    print(json.dumps({"type": "assistant", "message": first}), flush=True)
    results = []
    for block in first["content"]:
        if block["type"] == "tool_use" and block["name"] == "write_file":
            with open(block["input"]["path"], "w") as f:
                f.write(block["input"]["content"])
            results.append(
                {"type": "tool_result", "tool_use_id": block["id"], "content": "TOOL-RESULT written"}
            )
    if not results:
        print(json.dumps({"type": "result", "is_error": True, "result": "the model called no tool"}))
        return 1
    messages += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": results}]
    final = ask(messages, tools=[WRITE_FILE], max_tokens=8)
    text = "".join(b.get("text", "") for b in final["content"] if b["type"] == "text")
    print(json.dumps({"type": "result", "is_error": False, "result": text}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
