"""The train / held-out split of a synthetic task's question space, and the overlap of an evaluation set
with a training source.

A synthetic task (`ArithmeticTask`, `ChatQuestionTask`, `RunningSumTask`) draws its questions from a
finite space; a training stream and a held-out stream that both draw from all of it share questions
(100 one-digit sums, 1,600 training prompts: every held-out sum is trained on). Here a question
belongs to exactly one side, by a hash of its text that depends on nothing else (not on the seed, the
machine or the run): `is_heldout(question, fraction)`. A task built on the held-out `Side` draws only
held-out questions, one on the training side only training ones, so no seed's training stream
ever holds any seed's held-out question.

`overlap(source, prompts)` is the fraction of `prompts` whose question can occur in `source`'s
training stream: for a synthetic source, the share on its training side of the split (an upper
bound: a question outside the task's space counts as possible); for a file or dataset, the share
whose messages equal those of one of its prompts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence, TypeVar

from glmlight.errors import DataError
from glmlight.prompt import Prompt


HELDOUT_FRACTION = 0.2  # task.heldout_fraction's default: the share of a task's questions held out
MAX_DRAWS = 10_000  # draws for one item before a side is declared empty
MAX_SCAN = 1_000_000  # a source without `contains` is scanned whole only up to this many prompts

T = TypeVar("T")


def unit_hash(text: str) -> float:
    """A number in [0, 1) that depends only on `text` (the same on every machine, seed and run)."""
    digest = hashlib.blake2b(f"glmlight-split:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def is_heldout(question: str, fraction: float) -> bool:
    """Whether `question` is on the held-out side of the split that holds out `fraction` of the questions."""
    return unit_hash(question) < fraction


@dataclass(frozen=True)
class Side:
    """One side of the split: the held-out questions (`heldout=True`) or the training ones, of a split that
    holds out `fraction` of a task's questions."""

    heldout: bool = False
    fraction: float = HELDOUT_FRACTION

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise DataError(f"task.heldout_fraction={self.fraction} must be in (0, 1)")

    @property
    def name(self) -> str:
        return "held-out" if self.heldout else "training"

    def holds(self, question: str) -> bool:
        return is_heldout(question, self.fraction) == self.heldout

    def draw(self, draw: Callable[[random.Random], T], key: Callable[[T], str], rng: random.Random, what: str) -> T:
        """Draw with `draw(rng)` until the item's question `key(item)` is on this side. DataError when MAX_DRAWS
        draws never land here (the space is too small to split at this fraction)."""
        for _ in range(MAX_DRAWS):
            item = draw(rng)
            if self.holds(key(item)):
                return item
        raise DataError(f"{what}: no {self.name} question in {MAX_DRAWS} draws; the task's question space is too "
                        f"small to hold out task.heldout_fraction={self.fraction} of it (widen the task's ranges "
                        "or change the fraction)")


def question_key(prompt: Prompt) -> str:
    """The question a prompt asks: its `metadata['question']` when the task set one, else the text of its last
    user message (the system prompt and few-shot examples are the task's, not the question)."""
    q = prompt.metadata.get("question")
    if isinstance(q, str):
        return q
    users = [m for m in prompt.messages if m.get("role") == "user"]
    return str((users or prompt.messages)[-1].get("content", ""))


def messages_key(prompt: Prompt) -> Hashable:
    """A prompt's messages as a hashable value: what a file-backed source compares."""
    return tuple((str(m.get("role")), str(m.get("content"))) for m in prompt.messages)


def overlap(source: Any, prompts: Sequence[Prompt]) -> float | None:
    """The fraction of `prompts` that can occur in `source` (see the module docstring); None when it cannot be
    told (a source without `contains` that is too large to scan)."""
    if not prompts:
        return 0.0
    contains = getattr(source, "contains", None)
    if contains is None:
        if len(source) > MAX_SCAN:
            return None
        seen = {messages_key(source[i]) for i in range(len(source))}
        contains = lambda p: messages_key(p) in seen  # noqa: E731
    return sum(bool(contains(p)) for p in prompts) / len(prompts)
