"""A generative judge: an LLM behind a RolloutEngine reads (prompt, completion) and writes a score.

The judge prompt is `template` with {prompt}, {completion} and {label} filled in,
rendered with the judge tokenizer's chat template; the judge answers greedily (by
default) and `parse_judge_score` turns its text into a reward in [0, 1]. Output
without a recognisable score, or with a score outside [0, scale], raises a
ValueError naming what the judge said, which the reward machinery counts as a
failed sample (never a silent zero).

Samples are judged concurrently (task.reward_options.max_concurrency worker threads call
`generate` at once): the embedded engine batches concurrent requests (continuous batching),
server clients send them in parallel.

The judge is any RolloutEngine: `engine` (an engine object, or a spec with
`_target_`, e.g. the SGLang client) or `path` (a local checkpoint served by an
embedded LocalEngine). `tokenizer_path` is the judge's tokenizer (default: `path`,
else the built-in character tokenizer).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from glmlight.rewards.reward_model import cached_tokenizer, prompt_text
from glmlight.rewards.verifiers import completion_text
from glmlight.sample import Sample

DEFAULT_TEMPLATE = (
    "Rate the response to the question from 0 to 10.\n"
    "Question: {prompt}\nResponse: {completion}\n"
    "End with 'Score: N/10'."
)

_NUM = r"(-?\d+(?:\.\d+)?)"
# "Score: 7/10", "score = 0.7", "Rating: 8 out of 10", "**Score:** 7"; the last one counts.
_KEYWORD = re.compile(r"\b(?:score|rating|grade)\b\**\s*(?:is|of|=|:)?\s*\**\s*" + _NUM
                      + r"(?:\s*(?:/|out\s+of)\s*" + _NUM + r")?", re.IGNORECASE)
_BRACKETS = re.compile(r"\[\[\s*" + _NUM + r"\s*\]\]")  # MT-Bench style "[[7]]"
_FRACTION = re.compile(_NUM + r"\s*/\s*" + _NUM)


def parse_judge_score(text: str, scale: float = 10.0) -> float:
    """The judge's verdict in [0, 1]: the last "Score: a/b" (or a keyword score over `scale`),
    else the last "[[a]]" over `scale`, else the last bare fraction "a/b".

    Raises ValueError when there is no score or it lies outside [0, denominator].
    """
    if scale <= 0:
        raise ValueError(f"judge scale must be > 0, got {scale}")
    value, denom = None, None
    for pattern in (_KEYWORD, _BRACKETS, _FRACTION):
        found = pattern.findall(text)
        if found:
            last = found[-1] if isinstance(found[-1], tuple) else (found[-1],)
            value = float(last[0])
            denom = float(last[1]) if len(last) > 1 and last[1] else scale
            break
    if value is None:
        raise ValueError(f"judge output has no score (expected e.g. 'Score: 7/10'): {text[:160]!r}")
    if denom <= 0 or not 0 <= value <= denom:
        raise ValueError(f"judge score {value:g}/{denom:g} is outside [0, {denom:g}]: {text[:160]!r}")
    return value / denom


class GenerativeJudge:
    """Reward = the judge LLM's parsed score in [0, 1]; info holds the judge's text."""

    def __init__(self, engine: Any = None, *, path: str | None = None, tokenizer_path: str | None = None,
                 template: str = DEFAULT_TEMPLATE, scale: float = 10.0, max_new_tokens: int = 32,
                 temperature: float = 0.0, device: str = "cpu", dtype: str = "float32",
                 policy_tokenizer: str | None = None):
        if (engine is None) == (path is None):
            raise ValueError("GenerativeJudge needs exactly one of engine (a RolloutEngine or _target_ spec) or path")
        if "{completion}" not in template:
            raise ValueError("GenerativeJudge.template must contain {completion}")
        if isinstance(engine, Mapping):
            from hydra.utils import instantiate

            engine = instantiate(dict(engine), _convert_="all")
        self.tokenizer = cached_tokenizer(tokenizer_path or path,
                                          "task.reward.tokenizer_path" if tokenizer_path else "task.reward.path")
        if path is not None:
            from glmlight.models.loading import load_causal_lm
            from glmlight.engines.local.engine import LocalEngine

            engine = LocalEngine(load_causal_lm(path, self.tokenizer, dtype=dtype, key="task.reward.path"), dtype=dtype, device=device,
                                 pad_token_id=self.tokenizer.pad_token_id)
        if not callable(getattr(engine, "generate", None)):
            raise TypeError(f"GenerativeJudge.engine {type(engine).__name__} has no generate() method")
        self.engine, self.template, self.scale = engine, template, scale
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.policy_tokenizer = policy_tokenizer

    def judge_prompt(self, sample: Sample) -> str:
        label = sample.metadata.get("label")
        return (self.template.replace("{prompt}", prompt_text(sample, self.policy_tokenizer))
                .replace("{completion}", completion_text(sample))
                .replace("{label}", "" if label is None else str(label)))

    def judge_text(self, prompt: str) -> str:
        """The judge's raw answer to one judge prompt."""
        from glmlight.models.tokenizer import encode_chat, stop_token_ids
        from glmlight.engines.base import SamplingParams

        ids = encode_chat(self.tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        params = SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                stop_token_ids=stop_token_ids(self.tokenizer))
        (gen,) = self.engine.generate([ids], params)  # engines are thread-safe: concurrent calls batch
        return self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        text = self.judge_text(self.judge_prompt(sample))
        return parse_judge_score(text, self.scale), {"judge_text": text[:200]}

