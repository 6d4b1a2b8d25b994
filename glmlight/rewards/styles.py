"""Reward calling conventions: glmlight's own, TRL's and verl's, so that their reward functions run as they are.

`task.reward._target_` names the function; its style comes from its signature, or from
`task.reward_options.style` (auto | sample | trl | verl):

- sample (glmlight's): `fn(sample) -> float | (float, info)`; the sample's metadata holds
  "completion_text", "label", "domain" and the data row's other columns.
- trl (TRL GRPOTrainer's `_calculate_rewards`): `fn(prompts, completions, completion_ids, **columns)
  -> list[float | None]`, batched: glmlight calls it once per prompt group. The keyword arguments are
  every column of the data row (the label under its own column name, task.label_key, and as `label`),
  `trainer_state` (None: glmlight has no transformers TrainerState) and `log_extra` / `log_metric`
  (accepted and ignored). Completions are TRL's conversational messages
  `[{"role": "assistant", "content": text}]` when the prompt is a list of messages (glmlight renders
  every prompt with the chat template), plain strings when the sample carries a plain-string prompt.
  None for a sample means it cannot be scored: the sample is not trained on (rollout/reward_failed).
- verl (verl's NaiveRewardManager): `compute_score(data_source, solution_str, ground_truth, extra_info)
  -> float | dict` with data_source the row's `data_source` column (else its domain), ground_truth the
  label, extra_info the row's `extra_info` column (else {}); a dict result's "score" is the reward and
  the rest its info.

`check_reward_data` compares a TRL or verl reward's needs with the data's first prompt at start-up.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from glmlight.errors import ConfigError
from glmlight.config.schema import CHOICES
from glmlight.sample import SAMPLING_KEY, Sample

STYLES = CHOICES["task.reward_options.style"]
# What TRL's GRPOTrainer passes besides the dataset's columns.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
# Sample metadata that glmlight itself writes: not data columns.
_INTERNAL = {"completion_text", "reward_info", "reward_error", "reward_timeout", "prompt_index", "prompt_messages",
             "engine_error", SAMPLING_KEY}


def _parameters(fn: Any) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def detect_style(fn: Any) -> str:
    """"trl" for a function taking `completions`, "verl" for one taking `solution_str`, else "sample"."""
    params = _parameters(fn) or {}
    if "completions" in params:
        return "trl"
    if "solution_str" in params:
        return "verl"
    return "sample"


def _takes_all(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _required(params: dict[str, inspect.Parameter]) -> list[str]:
    return [n for n, p in params.items() if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]


def columns_of(label: Any, domain: str, metadata: dict[str, Any], label_key: str = "label") -> dict[str, Any]:
    """The data row's columns as a reward sees them: the label (as `label` and under task.label_key when that
    is a top-level key), the domain and every other column of the row."""
    cols = {k: v for k, v in metadata.items() if k not in _INTERNAL}
    cols["label"] = label
    if label_key and "." not in label_key:
        cols[label_key] = label
    cols.setdefault("domain", domain)
    return cols


def _name(fn: Any) -> str:
    f = getattr(fn, "func", fn)
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__name__)}"


class TrlReward:
    """A TRL-style batched reward function, called on one prompt group at a time."""

    batched = True

    def __init__(self, fn: Callable[..., Any], label_key: str = "label"):
        self.fn, self.label_key = fn, label_key
        params = _parameters(fn) or {}
        self._all = _takes_all(params) or not params
        self._accepts = set(params)

    def __call__(self, sample: Sample) -> Any:
        out = self.score_batch([sample])
        if inspect.isawaitable(out):
            import asyncio

            out = asyncio.run(_await(out))
        return list(out)[0]

    def score_batch(self, samples: list[Sample]) -> Any:
        prompts, completions = [], []
        for s in samples:
            prompt = s.metadata.get("prompt_messages")
            text = s.metadata.get("completion_text", "")
            prompts.append(prompt)
            completions.append(text if isinstance(prompt, str) else [{"role": "assistant", "content": text}])
        rows = [columns_of(s.metadata.get("label"), s.metadata.get("domain", "default"), s.metadata, self.label_key)
                for s in samples]
        kwargs: dict[str, Any] = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
        kwargs.update(prompts=prompts, completions=completions, completion_ids=[list(s.response_ids) for s in samples],
                      trainer_state=None, log_extra=_ignore, log_metric=_ignore)
        if not self._all:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepts}
        return self.fn(**kwargs)


class VerlReward:
    """A verl-style `compute_score(data_source, solution_str, ground_truth, extra_info)`, one sample a call."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        meta = sample.metadata
        extra = meta.get("extra_info")
        score = self.fn(data_source=meta.get("data_source") or meta.get("domain", "default"),
                        solution_str=meta.get("completion_text", ""), ground_truth=meta.get("label"),
                        extra_info=dict(extra) if isinstance(extra, dict) else {})
        if isinstance(score, dict):
            if "score" not in score:
                raise ValueError(f"the reward returned a dict without a 'score' key (keys: {sorted(score)})")
            return float(score["score"]), {k: v for k, v in score.items() if k != "score"}
        return score


def adapt(fn: Any, style: str = "auto", label_key: str = "label", target: str = "") -> Any:
    """`fn` wrapped for its calling convention (`style`, or the one its signature shows)."""
    if style not in STYLES:
        raise ConfigError(f"config error: task.reward_options.style={style!r} is not one of {list(STYLES)}")
    chosen = detect_style(fn) if style == "auto" else style
    params = _parameters(fn)
    if chosen == "trl":
        if params is not None and not _takes_all(params) and "completions" not in params:
            raise ConfigError(f"config error: task.reward ({target or _name(fn)}) is used as a TRL-style reward "
                              "(task.reward_options.style=trl) but takes no `completions` argument")
        return TrlReward(fn, label_key)
    if chosen == "verl":
        missing = [a for a in _required(params or {}) if a not in VERL_ARGUMENTS]
        if params is not None and not _takes_all(params) and "solution_str" not in params or missing:
            raise ConfigError(f"config error: task.reward ({target or _name(fn)}) is used as a verl-style "
                              "compute_score(data_source, solution_str, ground_truth, extra_info) but its "
                              f"signature is {inspect.signature(fn)}")
        return VerlReward(fn)
    return fn


def check_reward_data(reward: Any, label: Any, domain: str, metadata: dict[str, Any], label_key: str = "label"
                      ) -> None:
    """One line, at start-up, when a TRL or verl reward asks for what the data (its first prompt) lacks."""
    cols = columns_of(label, domain, metadata, label_key)
    present = sorted(k for k, v in cols.items() if v is not None)
    if isinstance(reward, TrlReward):
        params = _parameters(reward.fn) or {}
        missing = [a for a in _required(params) if a not in TRL_ARGUMENTS and cols.get(a) is None]
        if missing:
            hint = "" if missing[0] == label_key else \
                f"; set task.label_key={missing[0]} if it is the data's label column"
            raise ConfigError(f"config error: task.reward ({_name(reward.fn)}) asks for the column "
                              f"{missing[0]!r}, which the data does not have (columns: {present}){hint}")
    elif isinstance(reward, VerlReward) and label is None:
        raise ConfigError(f"config error: task.reward ({_name(reward.fn)}) is verl-style and scores against "
                          f"ground_truth, the label (task.label_key={label_key}), which the data does not have "
                          f"(columns: {present})")


def _ignore(*args: Any, **kwargs: Any) -> None:
    """TRL's log_extra / log_metric: accepted, not recorded."""


async def _await(x: Any) -> Any:
    return await x
