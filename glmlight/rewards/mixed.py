"""General-RL rewards: a weighted mix of rule verifiers, reward models and judges.

    task:
      reward:
        _target_: glmlight.rewards.mixed.MixedReward
        _recursive_: false          # MixedReward builds its components itself
        on_component_error: fail    # fail | zero
        components:
          correct: {weight: 0.7, reward: {_target_: glmlight.rewards.verifiers.NumericMatch}}
          rm:      {weight: 0.3, reward: {_target_: glmlight.rewards.reward_model.RemoteRewardModel,
                                          url: "http://rm:8000/score"}}

R = Σ_k w_k · R_k. Each component is built like `task.reward` (a class is instantiated,
a function is bound to its keyword arguments) or may be given as a ready callable
from Python. The info dict holds each component's score under its name (and the
component's own info under "<name>_info").

A failing component (it raises, or returns a non-finite value) fails the whole
sample by default: the sample is marked FAILED and counted, never trained on
with a partial reward. `on_component_error="zero"` instead scores that component
0.0 and lists it under info["failed_components"].
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from glmlight.errors import ConfigError
from glmlight.rewards.base import _unpack
from glmlight.sample import Sample


class RewardComponentError(ValueError):
    """One component of a MixedReward failed; the message names the component."""


class MixedReward:
    def __init__(self, components: Mapping[str, Any], on_component_error: str = "fail"):
        if on_component_error not in ("fail", "zero"):
            raise ConfigError(f"config error: MixedReward.on_component_error={on_component_error!r} is not one of "
                              "['fail', 'zero']")
        if isinstance(components, DictConfig):
            components = OmegaConf.to_container(components, resolve=True)
        if not components:
            raise ConfigError("config error: MixedReward needs at least one component")
        self.on_component_error = on_component_error
        self.components: dict[str, tuple[Callable[[Sample], Any], float]] = {}
        for name, spec in components.items():
            self.components[str(name)] = _build_component(str(name), spec)

    @property
    def weights(self) -> dict[str, float]:
        return {name: w for name, (_, w) in self.components.items()}

    async def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        info: dict[str, Any] = {}
        failed = []
        total = 0.0
        for name, (fn, weight) in self.components.items():
            try:
                out = fn(sample)
                if inspect.isawaitable(out):
                    out = await out
                value, comp_info = _unpack(out)
            except Exception as e:  # any component crash is reported by name
                if self.on_component_error == "fail":
                    raise RewardComponentError(f"reward component {name!r} failed: {type(e).__name__}: {e}") from e
                value, comp_info = 0.0, {"error": f"{type(e).__name__}: {e}"}
                failed.append(name)
            info[name] = value
            if comp_info:
                info[f"{name}_info"] = comp_info
            total += weight * value
        if failed:
            info["failed_components"] = failed
        return total, info

    def score(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        """Synchronous scoring (outside the reward machinery, e.g. in a notebook)."""
        from glmlight.rewards.base import _run

        return _run(self(sample))


def _build_component(name: str, spec: Any) -> tuple[Callable[[Sample], Any], float]:
    where = f"MixedReward component {name!r}"
    if not isinstance(spec, Mapping) or "reward" not in spec:
        raise ConfigError(f"config error: {where} must be {{reward: <spec with _target_ or callable>, weight: <number>}}")
    unknown = set(spec) - {"reward", "weight"}
    if unknown:
        raise ConfigError(f"config error: {where} has unknown key(s) {sorted(unknown)} (expected reward, weight)")
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ConfigError(f"config error: {where}: weight must be a finite number, got {weight!r}")
    reward = spec["reward"]
    if isinstance(reward, Mapping):
        from glmlight.rewards import build_reward

        try:
            reward = build_reward(reward)
        except ConfigError as e:
            raise ConfigError(f"config error: {where}: {str(e).removeprefix('config error: ')}") from None
        except Exception as e:  # noqa: BLE001 - a component that cannot be built is a config error
            raise ConfigError(f"config error: {where}: cannot build {reward.get('_target_')} "
                              f"({type(e).__name__}: {e})") from None
    if not callable(reward):
        raise ConfigError(f"config error: {where}: reward is not callable ({type(reward).__name__})")
    return reward, float(weight)
