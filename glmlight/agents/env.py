"""The Environment protocol for multi-turn agents.

reset(prompt) → the first messages (the task as the policy sees it);
step(action_text) → observation text, reward, done, info.
The environment only ever sees decoded text; the policy's actions stay token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Protocol

from glmlight.prompt import Prompt


@dataclass
class StepResult:
    observation: str | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, prompt: Prompt) -> list[dict[str, str]]:
        """Start an episode for `prompt`; return the opening chat messages."""

    def step(self, action: str) -> StepResult:
        """Apply the policy's action (decoded text of one turn)."""


def step_result_problem(result: Any) -> str | None:
    """What is wrong with an environment's `step` answer (None when it is a well-formed StepResult)."""
    if not isinstance(result, StepResult):
        return f"step returned {type(result).__name__}, expected a StepResult(observation, reward, done, info)"
    if result.observation is not None and not isinstance(result.observation, str):
        return f"step returned a {type(result.observation).__name__} observation, expected a str (or None)"
    if isinstance(result.reward, bool) or not isinstance(result.reward, Real) or not math.isfinite(result.reward):
        return f"step returned reward {result.reward!r}, expected a finite number"
    if not isinstance(result.info, dict):
        return f"step returned info of type {type(result.info).__name__}, expected a dict"
    return None
