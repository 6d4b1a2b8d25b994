"""Renamed config keys: the one home of the old names and of what moves each to its new one, in Hydra
overrides (`rename_overrides`, at compose) and in a config (`rename_keys`, at compose and in
`glmlight.config.validate`), with one deprecation line logged per old name.
"""
from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from glmlight.errors import ConfigError

log = logging.getLogger("glmlight")

# Renamed keys, old -> new: the old name still works for one release (compose rewrites it in the overrides,
# compose and validate in the config) with one line logged. `*` is any key at that level.
RENAMED = {
    "rollout.server.max_retries": "rollout.server.request_retries",
    "rollout.server.retry_backoff_s": "rollout.server.request_retry_backoff_s",
    "model.warm_start.schedule": "model.warm_start.lr_schedule",
    "algo.teachers.*.warm_start.schedule": "algo.teachers.*.warm_start.lr_schedule",
}
# Renamed constructor arguments of a callback (an entry of `callbacks` whose _target_ names the class).
RENAMED_ARGS = {"TruncatedIS": {"clip_low": "low", "clip_high": "high"}}


def _renamed(key: str) -> str | None:
    """The new name of dotted `key` when it is an old one (RENAMED), else None."""
    parts = key.split(".")
    for old, new in RENAMED.items():
        pattern = old.split(".")
        if len(pattern) == len(parts) and all(p in ("*", k) for p, k in zip(pattern, parts)):
            return ".".join(parts[:-1] + [new.rsplit(".", 1)[1]])
    return None


def _deprecated(old: str, new: str, logged: set[str]) -> None:
    if old not in logged:
        logged.add(old)
        log.warning("config: %s is deprecated; use %s", old, new)


def rename_overrides(overrides: list[str], logged: set[str]) -> list[str]:
    """Hydra overrides with every old key name (RENAMED) replaced by the new one."""
    out = []
    for o in overrides:
        prefix = o[:len(o) - len(o.lstrip("+~"))]
        key, eq, value = o[len(prefix):].partition("=")
        new = _renamed(key)
        if new is not None:
            _deprecated(key, new, logged)
            o = f"{prefix}{new}{eq}{value}"
        out.append(o)
    return out


def rename_keys(cfg: DictConfig, logged: set[str]) -> None:
    """Move every old key (RENAMED, and RENAMED_ARGS in callbacks entries) of `cfg` to its new name, in place."""
    def move(node: Any, path: str, old: str, new: str) -> None:
        with open_dict(node):
            if new in node:
                raise ConfigError(f"config error: both {path}{old} and its new name {path}{new} are set")
            node[new] = node.pop(old)
        _deprecated(f"{path}{old}", f"{path}{new}", logged)

    def walk(node: Any, pattern: list[str], path: str) -> None:
        head, rest = pattern[0], pattern[1:]
        for key in (list(node.keys()) if head == "*" else [head] if head in node else []):
            if not rest:
                new = _renamed(f"{path}{key}")
                if new is not None:
                    move(node, path, key, new.rsplit(".", 1)[1])
            elif OmegaConf.is_dict(node[key]):
                walk(node[key], rest, f"{path}{key}.")

    for old in RENAMED:
        walk(cfg, old.split("."), "")
    callbacks = cfg.get("callbacks")
    for name in list(callbacks or ()):
        entry = callbacks[name]
        target = entry.get("_target_") if OmegaConf.is_dict(entry) else None
        for old, new in RENAMED_ARGS.get(str(target).rsplit(".", 1)[-1], {}).items():
            if old in entry:
                move(entry, f"callbacks.{name}.", old, new)
