r"""MathVerify: math answers judged by the `math-verify` package (pip install 'glmlight[math]').

The completion's answer is its last `\boxed{}` (math-verify's LaTeX extraction, boxed first), else the
last LaTeX or plain expression in it (with `boxed_only=True`: a completion without `\boxed{}` scores
`-format_penalty`). The gold answer is the sample's label: a number (18, 0.5, "1,000") or LaTeX
(`\frac{1}{2}`, `2\sqrt{2}`, `x = 3`, `\$18`), parsed as if boxed. Equivalence is math-verify's
(symbolic and numeric: 0.5 = \frac{1}{2}, \dfrac, units and `\text{dollars}` dropped).

math-verify's own timeouts use `signal.alarm`, which works only in the main thread, so they are off here
(`parsing_timeout=None`, `timeout_seconds=None`); the per-sample timeout is glmlight's
(task.reward_options.timeout_s: a thread past it is abandoned, a process killed). A label that
math-verify cannot parse raises (the sample is counted in rollout/reward_failed).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from glmlight.errors import ConfigError
from glmlight.rewards.verifiers import completion_text, extract_boxed, label_of
from glmlight.sample import Sample

_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def _import() -> Any:
    try:
        import math_verify
        from latex2sympy2_extended import NormalizationConfig  # noqa: F401 - math-verify's parser
    except ImportError as e:
        raise ConfigError(f"config error: task.reward MathVerify needs the math-verify package ({e}); "
                          "pip install 'glmlight[math]'") from None
    # "Timeout is disabled" is logged on every call without timeouts: they are glmlight's (module docstring).
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


class MathVerify:
    r"""1.0 if the completion's answer equals the label by math-verify, else 0.0; info: pred, gold, format_ok."""

    def __init__(self, boxed_only: bool = False, format_penalty: float = 0.0, float_rounding: int = 6):
        _import()
        self.boxed_only, self.format_penalty, self.float_rounding = boxed_only, format_penalty, float_rounding

    def gold(self, label: Any) -> list[Any]:
        """The label parsed by math-verify (a plain number or LaTeX, with or without `$`/`\boxed{}`)."""
        mv = _import()
        text = str(label).strip()
        if _THOUSANDS.match(text):
            text = text.replace(",", "")
        if "\\boxed" not in text and "$" not in text.replace("\\$", ""):
            text = f"\\boxed{{{text}}}"
        parsed = mv.parse(text, parsing_timeout=None)
        if not parsed:
            raise ValueError(f"math-verify cannot parse the label {str(label)!r}")
        return parsed

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        mv = _import()
        from latex2sympy2_extended import NormalizationConfig

        text = completion_text(sample)
        boxed = extract_boxed(text)
        if self.boxed_only and boxed is None:
            return -self.format_penalty, {"pred": None, "format_ok": False}
        gold = self.gold(label_of(sample))
        config = [mv.LatexExtractionConfig(boxed_match_priority=0,
                                           normalization_config=NormalizationConfig(units=True)),
                  mv.ExprExtractionConfig()]
        # The last \boxed{} is the answer (math-verify alone would take the first of several).
        pred = mv.parse(f"\\boxed{{{boxed}}}" if boxed is not None else text, extraction_config=config,
                        parsing_timeout=None)
        ok = bool(pred) and mv.verify(gold, pred, float_rounding=self.float_rounding, timeout_seconds=None)
        return float(ok), {"pred": str(pred[-1]) if pred else None, "gold": str(gold[-1]),
                           "format_ok": boxed is not None}
