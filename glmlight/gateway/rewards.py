"""Task rewards over a gateway episode: they read the text of the episode's last turn
(`metadata["completion_text"]`) and the tool calls the gateway answered with
(`metadata["gateway_tool_calls"]`, `[{name, arguments}]`), as the environment's reward reads its
episode in `glmlight.agents.envs`."""

from __future__ import annotations

import re
from typing import Any

from glmlight.agents.envs import safe_eval
from glmlight.sample import Sample

_ANSWER = re.compile(r"answer:\s*(-?\d+)")


class CalculatorAnswer:
    """The calculator task's reward (`CalculatorEnv`'s): 1 when the last turn's first line is `answer: <n>`
    with the label's value. An episode that ends with an answer line whose value is wrong gets
    `correct_call_credit` when one of its `calc` calls (tool `calc`, argument `expr`) computed the
    label's value."""

    def __init__(self, correct_call_credit: float = 0.0, tool: str = "calc", argument: str = "expr"):
        if not 0.0 <= correct_call_credit < 1.0:
            raise ValueError(f"correct_call_credit must be in [0, 1), got {correct_call_credit}")
        self.correct_call_credit, self.tool, self.argument = correct_call_credit, tool, argument

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        target = int(sample.metadata["label"])
        text = sample.metadata.get("completion_text", "").strip()
        line = text.splitlines()[0].strip() if text else ""
        m = _ANSWER.fullmatch(line)
        correct = m is not None and int(m.group(1)) == target
        called = any(self._value(c) == target for c in sample.metadata.get("gateway_tool_calls", ())
                     if c.get("name") == self.tool)
        reward = 1.0 if correct else self.correct_call_credit if called and line.startswith("answer:") else 0.0
        return reward, {"correct": correct, "called_target": called}

    def _value(self, call: dict[str, Any]) -> int | None:
        try:
            return safe_eval(str(call.get("arguments", {}).get(self.argument, "")))
        except (ValueError, ZeroDivisionError, TypeError):
            return None
