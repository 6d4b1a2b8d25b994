"""Rewards: the protocol, verifiers, and building a reward from config."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping

from hydra.utils import get_object, instantiate

from glmlight.errors import ConfigError
from glmlight.rewards.base import RewardFn, score_samples


def build_reward(spec: Mapping[str, Any]) -> RewardFn:
    """`{_target_: a.Class, **kwargs}` builds an instance; `{_target_: a.function, **kwargs}`
    gives the function itself (with kwargs bound). The result must be callable on a Sample."""
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
    return fn


__all__ = ["RewardFn", "build_reward", "score_samples"]
