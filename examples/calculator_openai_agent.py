"""A calculator agent written against the official `openai` client only.

It asks the model, runs the tools the model calls (`calc`: the exact value of an integer
expression, `est`: the value to one significant figure), sends their results back, and returns the
model's first reply that calls no tool (the calculator task wants `answer: <n>`).

As a glmlight gateway agent (docs/agents.md), the rollout calls `run(task)` once per episode:

    python scripts/train.py task=gateway_agent task.agent.gateway.agent=examples/calculator_openai_agent.py:run

As a program against any OpenAI-compatible endpoint (the gateway's command mode sets these):

    OPENAI_BASE_URL=... OPENAI_API_KEY=... GLMLIGHT_PROMPT='[{"role": "user", "content": "37*58="}]' \\
        python examples/calculator_openai_agent.py
"""

from __future__ import annotations

import ast
import json
import operator
import os
import threading

from openai import OpenAI
from openai.types.chat import ChatCompletionMessage

TOOLS = [
    {"type": "function", "function": {
        "name": "calc", "description": "The exact value of an integer arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}},
    {"type": "function", "function": {
        "name": "est", "description": "The value of an integer arithmetic expression to one significant figure.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}},
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg}


def evaluate(expr: str) -> int:
    """Integer + - * // % and parentheses; anything else raises ValueError."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integer + - * // % and parentheses")

    if len(expr) > 64:
        raise ValueError("expression too long")
    try:
        return ev(ast.parse(expr.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"cannot parse {expr!r}") from None


def run_tool(name: str, arguments: dict) -> str:
    try:
        value = evaluate(str(arguments.get("expr", "")))
    except (ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    if name == "calc":
        return f"= {value}"
    if name == "est":
        digits = len(str(abs(value)))
        return f"~ {round(value, -(digits - 1)) if digits > 1 else value}"
    return f"error: no tool {name!r}"


def solve(client: OpenAI, messages: list[dict], model: str = "glmlight", max_turns: int = 3,
          stream: bool = False) -> str:
    """The model's final text (its first reply without a tool call; empty if the turns run out)."""
    messages = list(messages)
    for _ in range(max_turns):
        if stream:
            message = _streamed(client, model, messages)
        else:
            message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                     max_tokens=256).choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, json.loads(call.function.arguments))})
    return ""


def _streamed(client: OpenAI, model: str, messages: list[dict]):
    """The reply of a streamed request, put together from its chunks."""
    text, calls = [], {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=256,
                                                stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        text.append(delta.content or "")
        for c in delta.tool_calls or []:
            call = calls.setdefault(c.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] += c.id or ""
            call["function"]["name"] += (c.function.name or "") if c.function else ""
            call["function"]["arguments"] += (c.function.arguments or "") if c.function else ""
    message = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return ChatCompletionMessage.model_validate(message)


_shared: OpenAI | None = None
_lock = threading.Lock()


def run(task) -> None:
    """glmlight's gateway agent: `task` has the episode's `openai_base_url`, `api_key` and `messages`. One
    client per process (making one costs tens of milliseconds); each episode uses a copy with its own URL
    and key (`with_options` shares the connection pool)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0)
    solve(_shared.with_options(base_url=task.openai_base_url, api_key=task.api_key), task.messages)


if __name__ == "__main__":
    with OpenAI() as c:
        print(solve(c, json.loads(os.environ["GLMLIGHT_PROMPT"]), stream=os.environ.get("AGENT_STREAM") == "1"))
