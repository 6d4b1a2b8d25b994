"""Entry points shared by the scripts and the Python API: composing the Hydra config,
logging set-up and one-line errors."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from omegaconf import open_dict

log = logging.getLogger("glmlight")

# The Hydra configs: inside the installed package (glmlight/conf, package data), or the checkout's conf/
# beside the package (a source checkout or an editable install, as the README installs it).
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGED_CONF = os.path.join(_HERE, "conf")
CONF_DIR = (_PACKAGED_CONF if os.path.isfile(os.path.join(_PACKAGED_CONF, "train.yaml"))
            else os.path.join(os.path.dirname(_HERE), "conf"))


def compose(overrides: list[str] | tuple[str, ...] = (), config_dir: str | None = None) -> Any:
    """The run config from `conf/train.yaml` and Hydra overrides (`key=value`, `group=option`,
    `+new.key=value`, `~key`), as `python scripts/train.py OVERRIDES...` composes it.

    Works from any directory. `config_dir` replaces glmlight's `conf/` (copy it to add your own
    groups); the algorithms' schemas are registered first (glmlight.registry.discover).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from glmlight.config import rename_keys, rename_overrides
    from glmlight.registry import discover

    discover()
    root = os.path.abspath(config_dir or CONF_DIR)
    if not os.path.isfile(os.path.join(root, "train.yaml")):
        from glmlight.errors import ConfigError

        raise ConfigError(f"config error: no train.yaml in {root}; pass config_dir= (a copy of glmlight's conf/)")
    logged: set[str] = set()  # deprecated names, each logged once
    overrides = rename_overrides(list(overrides), logged)
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
    rename_keys(cfg, logged)
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


def setup_logging() -> None:
    """glmlight's log lines on stderr. Called again in the same process (a second run), it replaces the handler
    it added before, bound to the stderr of that time, so lines are neither repeated nor sent to a closed stream."""
    logger = logging.getLogger("glmlight")
    for old in [h for h in logger.handlers if h.get_name() == "glmlight-cli"]:
        logger.removeHandler(old)
    handler = logging.StreamHandler()
    handler.set_name("glmlight-cli")
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def one_line(e: BaseException) -> str:
    """The line a user error is reported with: `config error: ...` for a bad configuration (ConfigError,
    whose messages carry that prefix), `error: ...` for everything else; never both."""
    from glmlight.errors import ConfigError

    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, ConfigError):
        return msg if msg.startswith("config error:") else f"config error: {msg}"
    return msg if msg.startswith("error:") else f"error: {msg}"


def run_with_one_line_errors(fn: Callable[[], int | None]) -> int:
    """Run `fn`; a user error (bad config, data, engine) becomes one line on stderr and exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from glmlight.config import format_config_error
    from glmlight.errors import GlmlightError

    try:
        return fn() or 0
    except GlmlightError as e:
        print(one_line(e), file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as e:
        print(format_config_error(e), file=sys.stderr)
        return 2
