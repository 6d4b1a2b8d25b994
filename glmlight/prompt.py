"""What rollout starts from: a `Prompt` (chat messages, a label for the verifier, a domain for
routing) and a `PromptSource`, any indexable sequence of prompts (glmlight/data/sources.py has the
JSONL, Hugging Face and synthetic ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Prompt:
    messages: list[dict[str, str]]  # chat messages rendered with the tokenizer's chat template
    label: Any = None
    domain: str = "default"
    metadata: dict[str, Any] = field(default_factory=dict)
    # the prompt as a data file holds it (a string, or TRL's / verl's message list): what a TRL-style reward
    # receives as `prompts`; None for prompts made by a synthetic task
    original: Any = None


class PromptSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...


def last_user_message(messages: Any) -> str | None:
    """The text of the last user message of chat `messages` (the question a prompt asks), or None."""
    if not isinstance(messages, (list, tuple)):
        return None
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = " ".join(str(c.get("text", "")) if isinstance(c, dict) else str(c) for c in content)
            return None if content is None else str(content)
    return None

