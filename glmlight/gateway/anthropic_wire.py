"""Anthropic Messages on the wire (POST /v1/messages, as documented in Anthropic's API reference,
"Messages" and "Streaming Messages").

Served: `system` (a string or text blocks), messages of role user (text and `tool_result` blocks; a
result with `is_error: true` reaches the model as "Error: <its text>") and assistant (text and
`tool_use` blocks; a final assistant message is continued: the prefill), custom `tools`
(`input_schema`; `strict`: only calls whose arguments conform are returned), `tool_choice` auto,
none, any or tool (the turn starts with the template's tool-call opening, forced), `max_tokens`
(required), `temperature`, `top_p`, `top_k`, `stop_sequences`, `stream` (true, false or null;
message_start, content_block_start / _delta / _stop, message_delta, message_stop); and
POST /v1/messages/count_tokens (`parse_count_request`). A user message's tool results become tool
turns in order, then its text a user turn. Refused with a 400 in the wire's error form: other block
types (images, documents, thinking), server tools, extended thinking, a user message without a
content block. Ignored: `metadata`, `service_tier`, `tool_choice.disable_parallel_tool_use`, and fields
this module does not know (docs/agents.md lists them).
"""

from __future__ import annotations

import json
from typing import Any

from glmlight.gateway.messages import (AUTH, BAD_REQUEST, CLOSED, CONTEXT, NOT_FOUND, TOO_LARGE, Message,
                                       ToolCall, ToolSpec, TurnRequest, TurnResult, WireError, bad_request,
                                       forced_choice, number, request_messages, split_prefill, tool_spec)

ERROR_PREFIX = "Error: "  # what a tool result with is_error: true starts with in the model's context


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{where}.content[{j}] must be a content block with a type")
    return content


def _text_of(b: dict[str, Any], where: str) -> str:
    if not isinstance(b.get("text"), str):
        raise bad_request(f"{where}: a text block needs its text")
    return b["text"]


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(_text_of(b, f"{where}.content[{j}]") if isinstance(b, dict) and b.get("type") == "text"
                       else _unsupported(b, f"{where}.content[{j}]") for j, b in enumerate(content))
    raise bad_request(f"{where}.content must be a string or a list of text blocks")


def _unsupported(b: Any, where: str) -> str:
    kind = b.get("type") if isinstance(b, dict) else type(b).__name__
    raise bad_request(f"{where}: content blocks of type {kind!r} are not supported (text, tool_use and tool_result)")


def _messages(m: Any, i: int) -> list[Message]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        role = m.get("role") if isinstance(m, dict) else None
        raise bad_request(f"{where}: role must be user or assistant, got {role!r}")
    blocks = _blocks(m.get("content"), where)
    if m["role"] == "assistant":
        text, calls = [], []
        for j, b in enumerate(blocks):
            w = f"{where}.content[{j}]"
            if b["type"] == "text":
                text.append(_text_of(b, w))
            elif b["type"] == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise bad_request(f"{w}: a tool_use block needs its name and an input object")
                calls.append(ToolCall(str(b.get("id") or ""), b["name"], b.get("input") or {}))
            else:
                _unsupported(b, w)
        return [Message("assistant", "".join(text), calls)]
    if not blocks:
        raise bad_request(f"{where}: a user message needs at least one content block")
    out, text = [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content[{j}]"
        if b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_request(f"{w}: a tool_result block needs its tool_use_id")
            if b.get("is_error") not in (None, True, False):
                raise bad_request(f"{w}.is_error must be true or false, got {b['is_error']!r}")
            result = (ERROR_PREFIX if b.get("is_error") else "") + _result_text(b.get("content"), w)
            out.append(Message("tool", result, tool_call_id=b["tool_use_id"]))
        elif b["type"] == "text":
            text.append(_text_of(b, w))
        else:
            _unsupported(b, w)
    return out + ([Message("user", "".join(text))] if text or not out else [])


def _tools(tools: Any) -> list[ToolSpec]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{j}]: only custom tools ({{name, description, input_schema}}) are supported")
        out.append(tool_spec(t["name"], t.get("description"), t.get("input_schema"), t.get("strict"), f"tools[{j}]"))
    return out


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    """(auto | none | required, the tool a required call is of): Anthropic's any is required, tool names one."""
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in (None, "auto", "none"):
        return kind or "auto", None
    if kind == "any":
        return "required", None
    if kind == "tool":
        if not isinstance(choice, dict) or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice type 'tool' needs the tool's name")
        return "required", choice["name"]
    raise bad_request(f"tool_choice type {kind!r} is not supported: auto, any, tool or none")


def parse_request(body: Any) -> TurnRequest:
    msgs = request_messages(body)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request(f"max_tokens is required and must be a positive integer, got {max_tokens!r}")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise bad_request("extended thinking is not supported")
    kind, name = _tool_choice(body.get("tool_choice"))
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop_sequences must be a list of non-empty strings")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise bad_request(f"top_k must be a non-negative integer, got {top_k!r}")
    top_p = number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p must be in (0, 1]")
    if body.get("stream") not in (None, True, False):
        raise bad_request("stream must be true, false or null")
    system = body.get("system")
    head = []
    if system:
        head = [Message("system", system if isinstance(system, str) else
                        "".join(_text_of(b, f"system[{j}]") if b.get("type") == "text" else _unsupported(b, f"system[{j}]")
                                for j, b in enumerate(_blocks(system, "system"))))]
    messages, prefill = split_prefill(head + [x for i, m in enumerate(msgs) for x in _messages(m, i)])
    tools = _tools(body.get("tools"))
    kind, name = forced_choice(kind, name, tools, prefill, f"tool_choice type {'any' if name is None else 'tool'!r}",
                               "tool")
    return TurnRequest(
        messages=messages, tools=tools, tool_choice=kind, tool_name=name, prefill=prefill, max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 1.0), top_p=top_p, top_k=top_k, stop=stop,
        stream=bool(body.get("stream")), model=str(body.get("model") or ""))


def parse_count_request(body: Any) -> TurnRequest:
    """A POST /v1/messages/count_tokens body: a Messages request without `max_tokens`."""
    if isinstance(body, dict) and body.get("max_tokens") is None:
        body = {**body, "max_tokens": 1}
    return parse_request(body)


_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "stop_sequence": "stop_sequence"}


def _content(result: TurnResult) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": result.content}] if result.content else []
    return blocks + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in result.tool_calls]


def response(result: TurnResult, model: str) -> dict[str, Any]:
    return {"id": f"msg_{result.episode}_{result.turn}", "type": "message", "role": "assistant", "model": model,
            "content": _content(result), "stop_reason": _STOP[result.finish], "stop_sequence": result.stop_sequence,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens}}


def stream(result: TurnResult, model: str) -> list[bytes]:
    """The turn as server-sent events (the turn is generated whole, then sent)."""
    start = {**response(result, model), "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": result.prompt_tokens, "output_tokens": 0}}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for i, b in enumerate(_content(result)):
        if b["type"] == "text":
            opened, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": b["text"][j:j + 16]}
                                                            for j in range(0, len(b["text"]), 16)]
        else:
            opened = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(b["input"])}]
        events.append(("content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": _STOP[result.finish], "stop_sequence": result.stop_sequence},
                                     "usage": {"output_tokens": result.completion_tokens}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return [f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events]


_TYPES = {BAD_REQUEST: "invalid_request_error", CONTEXT: "invalid_request_error", CLOSED: "invalid_request_error",
          AUTH: "authentication_error", NOT_FOUND: "not_found_error", TOO_LARGE: "request_too_large"}


def error_body(err: WireError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(err.kind, "api_error"), "message": err.message}}
