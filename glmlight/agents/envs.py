"""Toy environments for the embedded default.

CalculatorEnv: the policy may call a calculator tool (`calc: <expr>`) and must
finish with `answer: <number>`; reward 1 for the right final answer (plus an
optional small bonus per well-formed tool call). RunningSumEnv: a long-horizon
task whose length can exceed the context budget: the environment reveals one
number per turn and the policy must reply with the running total each time;
reward is the fraction of correct totals.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from glmlight.agents.env import StepResult
from glmlight.prompt import Prompt

CALC_SYSTEM = "Tools: 'calc: <expr>' computes. Reply 'answer: <n>' to finish."

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def safe_eval(expr: str) -> int:
    """Integer arithmetic only (+ - * // %, parentheses); anything else raises ValueError."""
    if len(expr) > 64:
        raise ValueError("expression too long")

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integer + - * // % and parentheses are allowed")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expr!r}") from None
    return ev(tree)


class CalculatorEnv:
    def __init__(self, tool_bonus: float = 0.0):
        self.tool_bonus = tool_bonus
        self.target: int | None = None

    def reset(self, prompt: Prompt) -> list[dict[str, str]]:
        self.target = int(prompt.label)
        return [{"role": "system", "content": CALC_SYSTEM}] + [m for m in prompt.messages if m["role"] != "system"]

    def step(self, action: str) -> StepResult:
        line = action.strip().splitlines()[0].strip() if action.strip() else ""
        if line.startswith("calc:"):
            try:
                value = safe_eval(line[len("calc:"):])
            except (ValueError, ZeroDivisionError) as e:
                return StepResult(f"error: {e}", info={"tool_error": True})
            return StepResult(f"= {value}", reward=self.tool_bonus, info={"tool_calls": 1})
        if line.startswith("answer:"):
            m = re.fullmatch(r"answer:\s*(-?\d+)", line)
            correct = m is not None and int(m.group(1)) == self.target
            return StepResult(None, reward=1.0 if correct else 0.0, done=True, info={"correct": correct})
        return StepResult("error: reply 'calc: <expr>' or 'answer: <n>'", info={"malformed": True})


class RunningSumTask:
    """Prompts for RunningSumEnv: `num_steps` numbers in [1, max_value], a pure function of (seed, index)."""

    def __init__(self, num_steps: int = 8, max_value: int = 9, seed: int = 0, size: int = 100_000):
        self.num_steps, self.max_value, self.seed, self.size = num_steps, max_value, seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        deltas = [rng.randint(1, self.max_value) for _ in range(self.num_steps)]
        return Prompt(messages=[{"role": "user", "content": f"Keep a running sum. Start: {deltas[0]}"}],
                      label=str(sum(deltas)), domain="agent", metadata={"deltas": deltas})


class RunningSumEnv:
    def __init__(self) -> None:
        self.deltas: list[int] = []
        self.t = 0
        self.correct = 0

    def reset(self, prompt: Prompt) -> list[dict[str, str]]:
        self.deltas, self.t, self.correct = list(prompt.metadata["deltas"]), 0, 0
        return list(prompt.messages)

    def step(self, action: str) -> StepResult:
        total = sum(self.deltas[: self.t + 1])
        m = re.search(r"-?\d+", action)
        self.correct += int(m is not None and int(m.group()) == total)
        self.t += 1
        if self.t >= len(self.deltas):
            return StepResult(None, reward=self.correct / len(self.deltas), done=True,
                              info={"correct_totals": self.correct})
        return StepResult(f"+{self.deltas[self.t]}")
