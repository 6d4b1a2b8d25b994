"""Answer verifiers: rule-based rewards on the decoded completion.

The data module puts the decoded action text into sample.metadata["completion_text"]
(decoded for scoring only; the action itself stays as token ids) and the
reference answer into sample.metadata["label"].

BoxedMatch and NumericMatch compare numbers: plain (1,000, -0.5), fractions (\frac{1}{2}, \dfrac, 3/4)
and those wrapped in `$`, `\$`, `\text{units}` or `x =`; anything else in a boxed answer is compared
as normalised text. Symbolic answers (2\sqrt{2}, \pi, expressions) need MathVerify
(glmlight/rewards/mathverify.py), the default of task=jsonl.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
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


_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?|\.\d+"
_FRAC = re.compile(r"(-?)\\frac\{\s*(-?(?:%s))\s*\}\{\s*(-?(?:%s))\s*\}" % (_NUM, _NUM))
_SLASH = re.compile(r"(-?(?:%s))\s*/\s*(-?(?:%s))" % (_NUM, _NUM))
_PLAIN = re.compile(r"-?(?:%s)(?:[eE][-+]?\d+)?" % _NUM)
# A number in running text: a LaTeX fraction, a/b, or a plain number (the last one is the answer).
_ANY_NUMBER = re.compile(r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|(?:%s)\s*/\s*(?:%s)|(?:%s)(?:\s*\\?%%)?"
                         % (_NUM, _NUM, _PLAIN.pattern))


def normalize_answer(text: str) -> str:
    r"""An answer without its dressing: `$`, `\$`, `\text{...}` (units), `\left`/`\right`, spacing
    commands, a leading `x =`, a trailing period; `\dfrac`/`\tfrac` as `\frac`; no spaces."""
    t = str(text).strip()
    t = re.sub(r"\\(?:text|mbox|mathrm|textbf)\{[^{}]*\}", "", t)
    t = t.replace("\\$", "").replace("$", "")
    t = re.sub(r"\\(?:left|right)\b|\\[,;:! ]", "", t)
    t = re.sub(r"\\[dt]frac", r"\\frac", t)
    t = re.sub(r"^\s*[A-Za-z]\s*=\s*", "", t)
    t = t.strip().rstrip(".").strip()
    return re.sub(r"\s+", "", t)


def as_number(text: Any) -> Fraction | float | None:
    r"""`text` as a number when it is one after normalize_answer: 18, 1,000, -0.5, 1e3, \frac{1}{2}, 3/4."""
    t = normalize_answer(str(text))
    try:
        if _PLAIN.fullmatch(t):
            return Fraction(t.replace(",", ""))
        m = _FRAC.fullmatch(t)
        if m:
            value = Fraction(m.group(2).replace(",", "")) / Fraction(m.group(3).replace(",", ""))
            return -value if m.group(1) else value
        m = _SLASH.fullmatch(t)
        if m:
            return Fraction(m.group(1).replace(",", "")) / Fraction(m.group(2).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _close(a: Fraction | float, b: Fraction | float, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel_tol, abs_tol=abs_tol)


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
    r"""1.0 if the last number in the completion (plain, a/b or \frac{a}{b}) equals the label within
    tolerance. The label must be a number (18, 1,000, 0.5, \frac{1}{2}, \$18); any other label raises
    (use MathVerify for symbolic answers)."""

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 1e-9):
        self.rel_tol, self.abs_tol = rel_tol, abs_tol

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        label = label_of(sample)
        target = as_number(label)
        if target is None:
            raise ValueError(f"NumericMatch: the label {str(label)!r} is not a number; use "
                             "glmlight.rewards.mathverify.MathVerify for symbolic answers")
        found = _ANY_NUMBER.findall(completion_text(sample))
        pred = as_number(found[-1]) if found else None
        ok = pred is not None and _close(pred, target, self.rel_tol, self.abs_tol)
        return float(ok), {"pred": None if pred is None else float(pred)}


class BoxedMatch:
    r"""1.0 if the last \boxed{} answer matches the label: numerically when both are numbers (as_number:
    0.5 = \frac{1}{2} = 1/2, \$18 = 18 \text{ dollars} = 18, x = 3 = 3), else as normalised text."""

    def __init__(self, format_penalty: float = 0.0):
        self.format_penalty = format_penalty

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        boxed = extract_boxed(completion_text(sample))
        if boxed is None:
            return -self.format_penalty, {"pred": None, "format_ok": False}
        label = str(label_of(sample)).strip()
        pred = boxed.strip()
        a, b = as_number(pred), as_number(label)
        if a is not None and b is not None:
            ok = _close(a, b)
        else:
            ok = normalize_answer(pred) == normalize_answer(label)
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
