"""Rewards: the protocol, verifiers, and building a reward from config.

`task.reward` names the reward (`_target_` and its keyword arguments); how it runs (per-sample
timeout, concurrency, thread or process workers) is `task.reward_options` (glmlight.config.schema.RewardOptions,
applied by glmlight.rewards.base.RewardRunner). A TRL- or verl-style reward function is wrapped for its
calling convention (glmlight/rewards/styles.py; task.reward_options.style)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping

from hydra.utils import get_object, instantiate

from glmlight.errors import ConfigError
from glmlight.rewards.base import RewardFn, RewardRunner, score_samples
from glmlight.rewards.styles import adapt, check_reward_data

_OPTION_KEYS = ("timeout_s", "max_concurrency", "executor", "style")  # task.reward_options, not reward arguments


def build_reward(spec: Mapping[str, Any], style: str = "auto", label_key: str = "label") -> RewardFn:
    """`{_target_: a.Class, **kwargs}` builds an instance; `{_target_: a.function, **kwargs}`
    gives the function itself (with kwargs bound). A TRL- or verl-style function (by `style`, or by its
    signature) is wrapped so that the result is callable on a Sample (`label_key`: the data's label column,
    passed to a TRL-style function under that name)."""
    spec = dict(spec)
    target = spec.get("_target_")
    if not target:
        raise ConfigError("config error: task.reward needs a _target_ (a reward class or function)")
    try:
        obj = get_object(target)
    except Exception as e:  # noqa: BLE001
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config error: task.reward._target_={target!r} cannot be imported ({reason})") from None
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    _check_arguments(target, obj, {k: v for k, v in kwargs.items() if not k.startswith("_")})
    if inspect.isclass(obj):
        try:
            fn = instantiate(spec, _convert_="all")
        except Exception as e:  # noqa: BLE001 - Hydra wraps the class's own error; show that one
            while e.__cause__ is not None:
                e = e.__cause__
            raise ConfigError(f"config error: task.reward ({target}): {type(e).__name__}: {e}") from None
    else:
        fn = functools.partial(obj, **kwargs) if kwargs else obj
    if not callable(fn):
        raise ConfigError(f"config error: task.reward {target!r} is not callable")
    return adapt(fn, style, label_key, target)


def task_reward(task: Any, source: Any = None) -> RewardRunner:
    """The reward of a task config (task.reward, task.reward_options, task.label_key) under its options;
    with `source`, checked against its first prompt (a TRL or verl reward's columns)."""
    options = task.reward_options
    runner = RewardRunner(build_reward(task.reward, options.style, task.label_key), options)
    if source is not None and len(source):
        first = source[0]
        check_reward_data(runner.fn, first.label, first.domain, dict(first.metadata), task.label_key)
    return runner


def _check_arguments(target: str, obj: Any, kwargs: dict[str, Any]) -> None:
    """Keyword arguments the reward does not take are a config error now, not a failure on every sample."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        sig.bind_partial(**kwargs)
    except TypeError as e:
        hint = ""
        if set(kwargs) & set(_OPTION_KEYS) and not any(k in sig.parameters for k in _OPTION_KEYS):
            hint = ("; the per-sample timeout, concurrency, executor and calling convention (style) are "
                    "task.reward_options.*")
        raise ConfigError(f"config error: task.reward ({target}): {e}{hint}") from None


__all__ = ["RewardFn", "RewardRunner", "build_reward", "score_samples", "task_reward"]
