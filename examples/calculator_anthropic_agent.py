"""A calculator agent written against the official `anthropic` client only (streaming).

The same agent as calculator_openai_agent.py over the Messages API: it asks the model, runs the
tools the model calls (`calc`: the exact value of an integer expression, `est`: the value to one
significant figure), sends their results back as `tool_result` blocks, and returns the model's
first reply that calls no tool (the calculator task wants `answer: <n>`).

    python scripts/train.py task=gateway_agent task.agent.gateway.agent=examples/calculator_anthropic_agent.py:run

    ANTHROPIC_BASE_URL=... ANTHROPIC_API_KEY=... GLMLIGHT_PROMPT='[{"role": "user", "content": "37*58="}]' \\
        python examples/calculator_anthropic_agent.py
"""

from __future__ import annotations

import ast
import json
import operator
import os
import threading

from anthropic import Anthropic

_SCHEMA = {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}
TOOLS = [
    {"name": "calc", "description": "The exact value of an integer arithmetic expression.", "input_schema": _SCHEMA},
    {"name": "est", "description": "The value of an integer arithmetic expression to one significant figure.",
     "input_schema": _SCHEMA},
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


def solve(client: Anthropic, messages: list[dict], model: str = "glmlight", max_turns: int = 3) -> str:
    """The model's final text (its first reply without a tool call; empty if the turns run out)."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    convo = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    extra = {"system": system} if system else {}
    for _ in range(max_turns):
        with client.messages.stream(model=model, max_tokens=256, messages=convo, tools=TOOLS, **extra) as s:
            reply = s.get_final_message()
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        convo.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        convo.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": run_tool(u.name, u.input)} for u in uses]})
    return ""


_shared: Anthropic | None = None
_lock = threading.Lock()


def run(task) -> None:
    """glmlight's gateway agent: `task` has the episode's `anthropic_base_url`, `api_key` and `messages`. One
    client per process (making one costs tens of milliseconds); each episode uses a copy with its own URL
    and key (`with_options` shares the connection pool)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0)
    solve(_shared.with_options(base_url=task.anthropic_base_url, api_key=task.api_key), task.messages)


if __name__ == "__main__":
    with Anthropic() as c:
        print(solve(c, json.loads(os.environ["GLMLIGHT_PROMPT"])))
