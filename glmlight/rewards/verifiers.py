"""Answer verifiers: rule-based rewards on the decoded completion.

The data module puts the decoded action text into sample.metadata["completion_text"]
(decoded for scoring only; the action itself stays as token ids) and the
reference answer into sample.metadata["label"].
"""

from __future__ import annotations

import math
import re
from typing import Any

from glmlight.sample import Sample

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def completion_text(sample: Sample) -> str:
    try:
        return sample.metadata["completion_text"]
    except KeyError:
        raise KeyError("sample.metadata has no 'completion_text' (rewards run inside RolloutDataModule)") from None


def label_of(sample: Sample) -> Any:
    label = sample.metadata.get("label")
    if label is None:
        raise ValueError(f"sample {sample.rollout_id} has no label to verify against")
    return label


def extract_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...}, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


class ExactMatch:
    """1.0 if the stripped completion equals the stripped label, else 0.0."""

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        pred = completion_text(sample).strip()
        return float(pred == str(label_of(sample)).strip()), {"pred": pred}


class NumericMatch:
    """1.0 if the last number in the completion equals the label within tolerance."""

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 1e-9):
        self.rel_tol, self.abs_tol = rel_tol, abs_tol

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        pred = last_number(completion_text(sample))
        target = float(str(label_of(sample)).replace(",", ""))
        ok = pred is not None and math.isclose(pred, target, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
        return float(ok), {"pred": pred}


class BoxedMatch:
    r"""1.0 if the last \boxed{} answer matches the label (numerically when both are numbers)."""

    def __init__(self, format_penalty: float = 0.0):
        self.format_penalty = format_penalty

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        boxed = extract_boxed(completion_text(sample))
        if boxed is None:
            return -self.format_penalty, {"pred": None, "format_ok": False}
        label = str(label_of(sample)).strip()
        pred = boxed.strip()
        a, b = last_number(pred), last_number(label)
        ok = pred == label or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)
                               and _NUMBER.fullmatch(pred.replace(" ", "")) is not None)
        return float(ok), {"pred": pred, "format_ok": True}


_INTEGER = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z]+")


def list_items(text: str) -> list[str]:
    """The items of a comma-separated list label: "2, 7, 9" -> ["2", "7", "9"] (lower-cased)."""
    return [x.strip().lower() for x in str(text).split(",") if x.strip()]


class ListMatch:
    """1.0 if the completion ends its answer with the label's list, in order; else 0.0.

    The label is a comma-separated list ("2, 7, 9" or "map, sun, cat"). The completion's items are
    its integers (for a list of integers) or its words (otherwise, case-insensitive), keeping only
    those that occur in the label; the answer is the last n of them, n the label's length. So any
    wording around the list passes ("The sorted list is: 2, 7, 9.", "1. 2  2. 7  3. 9", restating
    the question first), and listing several orders earns nothing unless the last one is right.
    `pred` is the answer read, joined with ", "."""

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        want = list_items(label_of(sample))
        numbers = all(_INTEGER.fullmatch(x) for x in want)
        found = (_INTEGER if numbers else _WORD).findall(completion_text(sample))
        vocab = set(want)
        items = [x.lower() for x in found if x.lower() in vocab]
        pred = items[-len(want):] if want else []
        return float(bool(want) and pred == want), {"pred": ", ".join(pred) if pred else None}
