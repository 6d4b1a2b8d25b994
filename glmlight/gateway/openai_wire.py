"""OpenAI Chat Completions on the wire (POST /v1/chat/completions, as documented in OpenAI's API
reference, "Create chat completion" and "The chat completion chunk object").

Served: messages (system, developer, user, assistant with `tool_calls`, tool; text content, as a
string or text parts; a final assistant message is continued, as Anthropic's prefill), `tools` of type
function (`strict`: only calls whose arguments conform are returned), `tool_choice` auto, none,
required or a named function (the turn starts with the template's tool-call opening, forced; a call of
the named function finishes with `finish_reason: "stop"`, as OpenAI answers it, not "tool_calls"),
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `stop`, `stream` (true, false or null;
server-sent events, ending with `data: [DONE]`; `stream_options.include_usage`). Refused with a 400 in
the wire's error form: `n` > 1, `logprobs` / `top_logprobs`, non-zero penalties, `logit_bias`, a
`response_format` other than text, non-text content, the legacy `functions` / `function_call`, a
message without content (an assistant message needs content or tool calls). Ignored: `seed`
(sampling seeds are the run's), `user`, `metadata`, `store`, `parallel_tool_calls`, and fields this
module does not know (docs/agents.md lists them).
"""

from __future__ import annotations

import json
import time
from typing import Any

from glmlight.gateway.messages import (AUTH, BAD_REQUEST, CLOSED, CONTEXT, NOT_FOUND, TOO_LARGE, Message,
                                       ToolCall, ToolSpec, TurnRequest, TurnResult, WireError, bad_request,
                                       call_arguments, forced_choice, number, request_messages, split_prefill, tool_spec)

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: only text parts are supported, got {kind or type(part).__name__!r}")
        out.append(part["text"])
    return "".join(out)


def _tool_calls(calls: Any, where: str) -> list[ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or c.get("type", "function") != "function":
            raise bad_request(f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, arguments}}}}")
        args = call_arguments(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")
        out.append(ToolCall(str(c.get("id") or ""), fn["name"], args))
    return out


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        role = m.get("role") if isinstance(m, dict) else None
        raise bad_request(f"{where}: role must be one of {sorted(_ROLES)}, got {role!r}")
    role = _ROLES[m["role"]]
    if m.get("function_call") is not None:
        raise bad_request(f"{where}.function_call is the legacy form of tool_calls and is not supported: "
                          "send tool_calls")
    if role != "assistant" and m.get("content") is None:
        raise bad_request(f"{where}: a {m['role']} message needs its content (a string or a list of text parts)")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_request(f"{where}: a tool message needs its tool_call_id")
        return Message("tool", _text(m.get("content"), where), tool_call_id=m["tool_call_id"])
    calls = _tool_calls(m.get("tool_calls"), where) if role == "assistant" else []
    if role == "assistant" and m.get("content") is None and not calls:
        raise bad_request(f"{where}: an assistant message needs its content or its tool_calls")
    return Message(role, _text(m.get("content"), where), calls)


def _tools(tools: Any) -> list[ToolSpec]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list")
    out = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{j}]: only {{type: function, function: {{name, parameters}}}} tools are supported")
        out.append(tool_spec(fn["name"], fn.get("description"), fn.get("parameters"), fn.get("strict"),
                             f"tools[{j}].function"))
    return out


def _tool_choice(choice: Any) -> tuple[str, str | None]:
    """(auto | none | required, the function a required call is of)."""
    if choice in (None, "auto", "none", "required"):
        return choice or "auto", None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return "required", fn["name"]
    raise bad_request(f"tool_choice={choice!r} is not supported: auto, none, required or "
                      "{type: function, function: {name}}")


def parse_request(body: Any) -> TurnRequest:
    msgs = request_messages(body)
    if body.get("n") not in (None, 1):
        raise bad_request(f"n={body['n']!r} is not supported: the gateway samples one choice per request (n=1); "
                          "send one request per sample")
    if body.get("logprobs") or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not returned by this gateway (the trainer keeps the engine's log-probs)")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad_request(f"{key} is not supported (the policy's own distribution is sampled)")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported (the policy's own distribution is sampled)")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format is not supported (only type text)")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad_request("functions / function_call are the legacy form of tools / tool_choice and are not "
                          "supported: send tools and tool_choice")
    kind, name = _tool_choice(body.get("tool_choice"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad_request(f"max_tokens must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a string or a list of non-empty strings")
    if body.get("stream") not in (None, True, False):
        raise bad_request("stream must be true, false or null")
    options = body.get("stream_options") or {}
    top_p = number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p must be in (0, 1]")
    messages, prefill = split_prefill([_message(m, i) for i, m in enumerate(msgs)])
    tools = _tools(body.get("tools"))
    label = f"tool_choice={body.get('tool_choice')!r}" if name is None else "a tool_choice that names a function"
    named = name is not None
    kind, name = forced_choice(kind, name, tools, prefill, label, "function")
    return TurnRequest(
        messages=messages, tools=tools, tool_choice=kind, tool_name=name, tool_named=named, prefill=prefill,
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0), top_p=top_p, stop=stop, stream=bool(body.get("stream")),
        model=str(body.get("model") or ""),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")))


def _calls(result: TurnResult) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in result.tool_calls]


def _finish(result: TurnResult, req: TurnRequest) -> str:
    """The choice's finish_reason. A call of the function the request's tool_choice named finishes with "stop":
    OpenAI answers a named tool_choice so (the openai package documents "tool_calls" for a model that called a
    tool; OpenAI's own answer for a named function is "stop", and vLLM's server answers the same)."""
    if result.finish == "stop_sequence" or result.finish == "tool_calls" and req.tool_named:
        return "stop"
    return result.finish


def _usage(result: TurnResult) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def response(result: TurnResult, model: str, req: TurnRequest) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": result.content if result.content or not result.tool_calls else None}
    if result.tool_calls:
        message["tool_calls"] = _calls(result)
    return {"id": f"chatcmpl-{result.episode}-{result.turn}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "logprobs": None,
                                         "finish_reason": _finish(result, req)}], "usage": _usage(result)}


def stream(result: TurnResult, model: str, req: TurnRequest) -> list[bytes]:
    """The turn as server-sent events (the turn is generated whole, then sent)."""
    head = {"id": f"chatcmpl-{result.episode}-{result.turn}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""})]
    text = result.content
    events += [chunk({"content": text[i:i + 16]}) for i in range(0, len(text), 16)]
    events += [chunk({"tool_calls": [{"index": i, **c}]}) for i, c in enumerate(_calls(result))]
    events.append(chunk({}, _finish(result, req)))
    if req.include_usage:
        events.append({**head, "choices": [], "usage": _usage(result)})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


_TYPES = {BAD_REQUEST: "invalid_request_error", CONTEXT: "invalid_request_error", CLOSED: "invalid_request_error",
          AUTH: "authentication_error", NOT_FOUND: "invalid_request_error", TOO_LARGE: "invalid_request_error"}
_CODES = {CONTEXT: "context_length_exceeded"}


def error_body(err: WireError, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": _TYPES.get(err.kind, "server_error"), "param": None,
                      "code": code or _CODES.get(err.kind)}}
