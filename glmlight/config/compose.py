"""A run's config from glmlight's Hydra configs (conf/) and overrides, as `python scripts/train.py
OVERRIDES...` composes it."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from omegaconf import open_dict

log = logging.getLogger("glmlight")

# The Hydra configs: inside the installed package (glmlight/conf, package data), or the checkout's conf/
# beside the package (a source checkout or an editable install, as the README installs it).
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the glmlight package
_PACKAGED_CONF = os.path.join(_HERE, "conf")
CONF_DIR = (_PACKAGED_CONF if os.path.isfile(os.path.join(_PACKAGED_CONF, "train.yaml"))
            else os.path.join(os.path.dirname(_HERE), "conf"))


def compose(overrides: list[str] | tuple[str, ...] = (), config_dir: str | None = None) -> Any:
    """The run config from `conf/train.yaml` and Hydra overrides (`key=value`, `group=option`,
    `+new.key=value`, `~key`), as `python scripts/train.py OVERRIDES...` composes it.

    Works from any directory. `config_dir` replaces glmlight's `conf/` (copy it to add your own
    groups); the algorithms' schemas are registered first (glmlight.config.registry.discover).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from glmlight.config.registry import discover

    discover()
    root = os.path.abspath(config_dir or CONF_DIR)
    if not os.path.isfile(os.path.join(root, "train.yaml")):
        from glmlight.errors import ConfigError

        raise ConfigError(f"config error: no train.yaml in {root}; pass config_dir= (a copy of glmlight's conf/)")
    overrides = list(overrides)
    with initialize_config_dir(config_dir=root, version_base="1.3"):
        try:
            cfg = hydra_compose(config_name="train", overrides=overrides, return_hydra_config=True)
        except (AssertionError, TypeError, ValueError) as e:  # OmegaConf's own faults on an impossible override
            raise _override_error(overrides, hydra_compose, e) from None
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/") and v is not None}
    for line in cross_group_settings(root, choices):
        log.info(line)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def cross_group_settings(root: str, choices: dict[str, str]) -> list[str]:
    """One line for each chosen group option that sets keys outside its own group or chooses another
    group's option (e.g. algo=sao sets rollout.mode; model_algo=tiny_sao, a setting of a combination of two
    choices, sets model.warm_start): no group changes another's settings unseen. An `experiment` is a whole
    recipe and sets what it likes."""
    import yaml

    out = []
    for group, option in sorted(choices.items()):
        path = os.path.join(root, group, f"{option}.yaml")
        if group == "experiment" or not os.path.isfile(path):
            continue
        with open(path) as f:
            text = f.read()
        if "@package _global_" not in text.split("\n", 1)[0] and "# @package _global_" not in text[:200]:
            continue
        body = yaml.safe_load(text) or {}
        chosen = [f"{d.split()[1].strip('/').rstrip(':')}={v}" for entry in body.get("defaults", []) if isinstance(entry, dict)
                  for d, v in entry.items() if d.startswith("override ")]
        keys = [f"{top}.{k}" if isinstance(v, dict) else top for top, v in body.items()
                if top not in ("defaults", group) for k in (v if isinstance(v, dict) else [None])]
        if chosen or keys:
            parts = ([f"chooses {', '.join(chosen)}"] if chosen else []) + ([f"sets {', '.join(keys)}"] if keys else [])
            out.append(f"{group}={option} also {' and '.join(parts)} ({os.path.relpath(path, root)})")
    return out


def _override_error(overrides: list[str], hydra_compose: Callable[..., Any], e: BaseException) -> Exception:
    """One line for an override Hydra cannot apply, naming it: typically a key below an entry that is
    null in this config (e.g. task.agent.env._target_ on a task without an agent environment)."""
    from omegaconf import OmegaConf

    from glmlight.errors import ConfigError

    plain = [o for o in overrides if "=" in o and not o.startswith(("+", "~"))]
    try:
        base = hydra_compose(config_name="train", overrides=[o for o in overrides if o not in plain])
    except Exception:  # noqa: BLE001 - only the diagnosis failed
        base = None
    for o in plain:
        key = o.split("=", 1)[0]
        parts = key.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if base is not None and OmegaConf.select(base, parent, default="missing") is None:
                return ConfigError(f"config error: {key} cannot be set: {parent} is null in this config; give the "
                                   f"whole entry instead, e.g. '{parent}={{{'.'.join(parts[i:])}: ...}}'")
    return ConfigError(f"config error: the overrides {overrides} cannot be applied ({type(e).__name__}: {e})")
