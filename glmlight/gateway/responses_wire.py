"""OpenAI Responses on the wire (POST /v1/responses, as the `openai` package's types describe it:
`ResponseCreateParams`, `Response`, `ResponseStreamEvent`).

Served: `input` as a string (one user message) or a list of items: messages (role user, assistant,
system or developer; content a string or `input_text` / `output_text` parts), `function_call` items
(an assistant turn's calls: they join the assistant message item before them, as the gateway's own
answers list them) and `function_call_output` items (tool results); an assistant message item right
after another joins it too (one answer: a prefill and its continuation, as a client appends them); a
final assistant message is continued, as on the other wires (the prefill: the answer's message item
holds only the continuation); `instructions` (a system message first); function `tools` in the
Responses form (`{type: function, name, description, parameters, strict}`; `strict: true`: only calls
whose arguments conform are returned), `tool_choice` auto, none, required, a named function
(`{type: function, name}`: the turn starts with the template's tool-call opening, forced) or
`allowed_tools` (mode auto or required: the turn's calls may be of those function tools only; required
forces a call, of the one tool when one is allowed), `max_output_tokens`, `temperature`, `top_p`,
`stream` (server-sent events, each with its `sequence_number`: response.created, response.in_progress,
per output item output_item.added, its text part's or arguments' events, output_item.done, then
response.completed). `usage` carries input, output and total tokens with their details objects. A turn
cut at the token budget (the request's `max_output_tokens` or the run's per-turn budget) is
`status: incomplete` with `incomplete_details.reason: max_output_tokens`, as the API reports it, and the
stream ends with response.incomplete.

Refused with a 400 in the wire's error form: `previous_response_id` and `conversation` (the gateway
keeps no responses: send the whole conversation, as the Agents SDK and pydantic-ai do by default),
`background`, `prompt` templates, `context_management`, `reasoning` and `item_reference` input items
(the gateway never produces either), content other than text, tools other than functions, a
`tool_choice` of another tool type (hosted tools, MCP, custom tools), a forced one naming an undeclared
tool, without tools or beside a prefill, a final `function_call` item (its output comes first), a
`text.format` other than text, and log-probs (`top_logprobs`, `include` of
`message.output_text.logprobs`). Ignored: `store` (nothing is stored), `parallel_tool_calls` and
`metadata` (echoed), `reasoning`, `truncation`, the rest of `include`, `user`, `safety_identifier`,
`service_tier`, `prompt_cache_key` / `_retention` / `_options`, `max_tool_calls`, `stream_options`,
`text.verbosity`, and fields this module does not know. A tool that omits `strict` is not strict here:
OpenAI's Responses API makes such a tool strict and rewrites its schema into strict form (no additional
properties, every property required); the gateway rewrites no schema.

The answer repeats some of the request's settings (tools, tool_choice, parallel_tool_calls, ...), so
`response` and `stream` take the parsed request, a `ResponsesRequest`, beside the turn's result.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from glmlight.gateway.messages import (Message, ToolCall, ToolSpec, TurnRequest, TurnResult, bad_request,
                                       call_arguments, forced_choice, number, split_prefill, tool_spec)
from glmlight.gateway.openai_wire import error_body  # noqa: F401 - the OpenAI API's error form, one for both wires

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")


@dataclass
class ResponsesRequest(TurnRequest):
    echo: dict[str, Any] = field(default_factory=dict)  # the request's settings the answer repeats


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported, "
                              f"got {kind or type(part).__name__!r}")
        out.append(part["text"])
    return "".join(out)


def _call(item: dict[str, Any], where: str) -> ToolCall:
    if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
        raise bad_request(f"{where}: a function_call item needs its name and call_id")
    return ToolCall(item["call_id"], item["name"], call_arguments(item.get("arguments"), f"{where}.arguments"))


def _messages(items: Any) -> list[Message]:
    """The conversation of `input`. A function_call item joins the assistant message just before it (the
    text and calls of one answer, as `response` lists them); without one it opens an assistant message. An
    assistant message item right after another (without calls) joins it, its text after the other's: a
    prefill and the answer that continues it, as a client that appends the output items sends them."""
    if isinstance(items, str):
        return [Message("user", items)]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of input items")
    out: list[Message] = []
    calls_join = False  # the last message is an assistant answer that a function_call item continues
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an input item object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}: role must be one of {sorted(_ROLES)}, got {role!r}")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant" and calls_join and not out[-1].tool_calls:
                out[-1].content += text
            else:
                out.append(Message(_ROLES[role], text))
            calls_join = role == "assistant"
        elif kind == "function_call":
            call = _call(item, where)
            if calls_join:
                out[-1].tool_calls.append(call)
            else:
                out.append(Message("assistant", "", [call]))
                calls_join = True
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output item needs its call_id")
            out.append(Message("tool", _text(item.get("output"), f"{where}.output"), tool_call_id=item["call_id"]))
            calls_join = False
        elif kind == "reasoning":
            raise bad_request(f"{where}: reasoning items are not supported: the gateway never produces them (the "
                              "model's text, reasoning included, is in its message items)")
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references are not supported: the gateway stores no items; send the "
                              "items themselves")
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output)")
    return out


def _tools(tools: Any) -> tuple[list[ToolSpec], list[dict[str, Any]]]:
    """The declared tools, and their Responses form as the answer repeats it."""
    if tools is None:
        return [], []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list")
    specs, echo = [], []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(f"tools[{j}]: only function tools ({{type: function, name, parameters}}) are "
                              f"supported, got {kind!r}")
        spec = tool_spec(t["name"], t.get("description"), t.get("parameters"), t.get("strict"), f"tools[{j}]")
        specs.append(spec)
        echo.append({"type": "function", "name": spec.name, "description": spec.description or None,
                     "parameters": spec.parameters, "strict": t.get("strict")})
    return specs, echo


def _tool_choice(choice: Any) -> tuple[str, str | None, list[str] | None]:
    """(auto | none | required, the function a required call is of, the functions the turn may call): the
    Responses API's named function is `{type: function, name}`; `allowed_tools` restricts the calls."""
    if choice in (None, "auto", "none", "required"):
        return choice or "auto", None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return "required", choice["name"], None
    if kind != "allowed_tools":
        raise bad_request(f"tool_choice={choice!r} is not supported: auto, none, required, {{type: function, name}} "
                          "or {type: allowed_tools, mode, tools}")
    if choice.get("mode") not in ("auto", "required"):
        raise bad_request(f"tool_choice.mode must be auto or required, got {choice.get('mode')!r}")
    tools = choice.get("tools")
    if not isinstance(tools, list) or not tools:
        raise bad_request("tool_choice.tools must be a non-empty list")
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            got = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(f"tool_choice.tools[{j}]: only function tools ({{type: function, name}}) can be "
                              f"allowed, got {got!r}")
    return choice["mode"], None, [t["name"] for t in tools]


def parse_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, why in (("previous_response_id", "the gateway keeps no responses; send the whole conversation in "
                                              "input"),
                     ("conversation", "the gateway keeps no conversations; send the whole conversation in input"),
                     ("prompt", "prompt templates are not supported; send instructions and input"),
                     ("context_management", "server-side compaction is not supported")):
        if body.get(key) not in (None, [], {}):
            raise bad_request(f"{key} is not supported: {why}")
    if body.get("background"):
        raise bad_request("background responses are not supported: each request is answered when its turn is "
                          "generated")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad_request("include must be a list")
    if body.get("top_logprobs") not in (None, 0) or "message.output_text.logprobs" in include:
        raise bad_request("logprobs are not returned by this gateway (the trainer keeps the engine's log-probs)")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and not isinstance(text, dict) or fmt is not None and not (
            isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("text.format is not supported (only type text)")
    choice = body.get("tool_choice")
    kind, name, allowed = _tool_choice(choice)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad_request(f"max_output_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(body.get("stream", False), bool):
        raise bad_request("stream must be true or false")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be true or false")
    top_p = number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p must be in (0, 1]")
    temperature = number(body, "temperature", 0.0, 2.0)
    tools, tools_echo = _tools(body.get("tools"))
    messages, prefill = split_prefill(([Message("system", instructions)] if instructions else [])
                                      + _messages(body.get("input")))
    label = (f"tool_choice={choice!r}" if kind == "required" and name is None and allowed is None
             else "a tool_choice that names a function" if name is not None else "tool_choice allowed_tools")
    tool_choice, tool_name = forced_choice(kind, name, tools, prefill, label, "function", allowed)
    metadata = body.get("metadata")
    return ResponsesRequest(
        messages=messages, tools=tools, tool_choice=tool_choice, tool_name=tool_name, tool_named=name is not None,
        allowed=allowed, prefill=prefill, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        stream=bool(body.get("stream", False)), model=str(body.get("model") or ""),
        echo={"instructions": instructions, "tools": tools_echo, "tool_choice": choice or "auto",
              "parallel_tool_calls": parallel, "max_output_tokens": max_tokens, "temperature": temperature,
              "top_p": top_p, "metadata": metadata if isinstance(metadata, dict) else None})


def _id(result: TurnResult) -> str:
    return f"resp_{result.episode}_{result.turn}"


def _output(result: TurnResult) -> list[dict[str, Any]]:
    """The turn's output items: its text as a message (also when there is neither text nor a call), then one
    function_call item per call. A turn cut at the token budget has its items incomplete."""
    status = "incomplete" if result.finish == "length" else "completed"
    items: list[dict[str, Any]] = []
    if result.content or not result.tool_calls:
        items.append({"id": f"msg_{result.episode}_{result.turn}", "type": "message", "role": "assistant",
                      "status": status, "content": [{"type": "output_text", "text": result.content,
                                                     "annotations": [], "logprobs": []}]})
    items += [{"id": f"fc_{c.id}", "type": "function_call", "call_id": c.id, "name": c.name,
               "arguments": json.dumps(c.arguments), "status": status} for c in result.tool_calls]
    return items


def _usage(result: TurnResult) -> dict[str, Any]:
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def _response(result: TurnResult, model: str, req: ResponsesRequest, created: int, done: bool) -> dict[str, Any]:
    """The Response object: as it ends (`done`), or as response.created and response.in_progress show it."""
    cut = result.finish == "length"
    e = req.echo
    return {"id": _id(result), "object": "response", "created_at": created,
            "status": ("incomplete" if cut else "completed") if done else "in_progress",
            "completed_at": int(time.time()) if done and not cut else None, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if done and cut else None,
            "instructions": e.get("instructions"), "max_output_tokens": e.get("max_output_tokens"),
            "metadata": e.get("metadata"), "model": model, "output": _output(result) if done else [],
            "parallel_tool_calls": e.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": e.get("temperature"),
            "text": {"format": {"type": "text"}}, "tool_choice": e.get("tool_choice", "auto"),
            "tools": e.get("tools", []), "top_p": e.get("top_p"), "truncation": "disabled",
            "usage": _usage(result) if done else None, "user": None}


def response(result: TurnResult, model: str, req: ResponsesRequest) -> dict[str, Any]:
    return _response(result, model, req, int(time.time()), True)


def stream(result: TurnResult, model: str, req: ResponsesRequest) -> list[bytes]:
    """The turn as server-sent events (the turn is generated whole, then sent)."""
    created = int(time.time())
    opening = _response(result, model, req, created, False)
    events: list[dict[str, Any]] = [{"type": "response.created", "response": opening},
                                    {"type": "response.in_progress", "response": opening}]
    for i, item in enumerate(_output(result)):
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events += [{"type": "response.output_item.added", "output_index": i,
                        "item": {**item, "status": "in_progress", "content": []}},
                       {"type": "response.content_part.added", **where, "content_index": 0,
                        "part": {**part, "text": ""}}]
            events += [{"type": "response.output_text.delta", **where, "content_index": 0, "delta": text[j:j + 16],
                        "logprobs": []} for j in range(0, len(text), 16)]
            events += [{"type": "response.output_text.done", **where, "content_index": 0, "text": text,
                        "logprobs": []},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        else:
            events += [{"type": "response.output_item.added", "output_index": i,
                        "item": {**item, "status": "in_progress", "arguments": ""}},
                       {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"],
                        "name": item["name"]}]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    final = _response(result, model, req, created, True)
    events.append({"type": f"response.{final['status']}", "response": final})
    return [f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n".encode()
            for n, e in enumerate(events)]
