"""General-RL rewards: a weighted mix of rule verifiers, reward models and judges, and one verifier
per prompt domain (`ByDomain`, for a prompt mix such as cross-stage distillation's).

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

The mix is a synchronous reward: it runs in a reward worker under `task.reward_options`
(timeout and concurrency across samples), its components one after another per sample
(an async component is awaited inside; `acall` is the async variant).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from glmlight.errors import ConfigError
from glmlight.rewards.workers import unpack as _unpack
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

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        """Synchronous (it runs in a reward worker: a slow component never blocks an event loop); an async
        component is run to completion here."""
        return self._combine(sample, (self._component(name, fn, sample) for name, (fn, _) in self.components.items()))

    async def acall(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        """The same reward for async callers (components that are coroutines are awaited)."""
        parts = []
        for name, (fn, _) in self.components.items():
            try:
                out = fn(sample)
                if inspect.isawaitable(out):
                    out = await out
                parts.append((name, _unpack(out), None))
            except Exception as e:  # noqa: BLE001 - any component crash is reported by name
                parts.append((name, None, e))
                if self.on_component_error == "fail":
                    break
        return self._combine(sample, parts)

    def score(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        """Scoring outside the reward machinery (e.g. in a notebook)."""
        return self(sample)

    def _component(self, name: str, fn: Callable[[Sample], Any], sample: Sample):
        try:
            return name, _call(fn, sample), None
        except Exception as e:  # noqa: BLE001 - any component crash is reported by name
            return name, None, e

    def _combine(self, sample: Sample, parts: Iterable) -> tuple[float, dict[str, Any]]:
        """Σ w·R over (name, (value, info) | None, error | None) parts; a generator is consumed lazily, so with
        on_component_error="fail" nothing after the first failing component runs."""
        info: dict[str, Any] = {}
        failed = []
        total = 0.0
        for name, result, error in parts:
            if error is not None:
                if self.on_component_error == "fail":
                    raise RewardComponentError(f"reward component {name!r} failed: {type(error).__name__}: "
                                               f"{error}") from error
                result = 0.0, {"error": f"{type(error).__name__}: {error}"}
                failed.append(name)
            value, comp_info = result
            info[name] = value
            if comp_info:
                info[f"{name}_info"] = comp_info
            total += self.components[name][1] * value
        if failed:
            info["failed_components"] = failed
        return total, info


class ByDomain:
    """Each sample scored by its prompt domain's reward (`sample.metadata["domain"]`): a mix of task
    families, each checked as its own task is (the sum's last number, the sorted list's items).

        task:
          reward:
            _target_: glmlight.rewards.mixed.ByDomain
            _recursive_: false
            routes:
              math: {_target_: glmlight.rewards.verifiers.NumericMatch}
              sort: {_target_: glmlight.rewards.verifiers.ListMatch}

    A sample of a domain with no route (or none) raises, which fails that sample by name: it is counted,
    never scored by another domain's rule. The info dict is the route's own, plus "domain"."""

    def __init__(self, routes: Mapping[str, Any]):
        if isinstance(routes, DictConfig):
            routes = OmegaConf.to_container(routes, resolve=True)
        if not routes:
            raise ConfigError("config error: ByDomain needs at least one route (domain: reward spec)")
        self.routes = {str(domain): _build_component(str(domain), {"reward": spec}, f"ByDomain route {domain!r}")[0]
                       for domain, spec in routes.items()}

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        domain = sample.metadata.get("domain")
        if domain is None or str(domain) not in self.routes:
            raise KeyError(f"ByDomain has no reward for domain {domain!r} (routes: {sorted(self.routes)})")
        value, info = _call(self.routes[str(domain)], sample)
        return value, {**info, "domain": str(domain)}


def _call(fn: Callable[[Sample], Any], sample: Sample) -> tuple[float, dict[str, Any]]:
    """One reward on one sample, synchronously (an async reward is run to completion), as (value, info)."""
    out = fn(sample)
    if inspect.isawaitable(out):
        from glmlight.rewards.base import _run

        out = _run(_await(out))
    return _unpack(out)


async def _await(x):
    return await x


def _build_component(name: str, spec: Any, where: str = "") -> tuple[Callable[[Sample], Any], float]:
    where = where or f"MixedReward component {name!r}"
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
