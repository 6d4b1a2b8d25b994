"""The Environment protocol for multi-turn agents.

reset(prompt) → the first messages (the task as the policy sees it);
step(action_text) → observation text, reward, done, info.
The environment only ever sees decoded text; the policy's actions stay token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
