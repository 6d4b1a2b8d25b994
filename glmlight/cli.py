"""Entry points shared by the scripts and the Python API: composing the Hydra config,
logging set-up and one-line errors."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

# conf/ beside the package (a source checkout or an editable install, as the README installs it).
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose(overrides: list[str] | tuple[str, ...] = (), config_dir: str | None = None) -> Any:
    """The run config from `conf/train.yaml` and Hydra overrides (`key=value`, `group=option`,
    `+new.key=value`, `~key`), as `python scripts/train.py OVERRIDES...` composes it.

    Works from any directory. `config_dir` replaces glmlight's `conf/` (copy it to add your own
    groups); the algorithms' schemas are registered first (glmlight.registry.discover).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from glmlight.registry import discover

    discover()
    root = os.path.abspath(config_dir or CONF_DIR)
    if not os.path.isfile(os.path.join(root, "train.yaml")):
        from glmlight.errors import ConfigError

        raise ConfigError(f"config error: no train.yaml in {root}; pass config_dir= (a copy of glmlight's conf/)")
    with initialize_config_dir(config_dir=root, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides))


def setup_logging() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("glmlight")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def run_with_one_line_errors(fn: Callable[[], int | None]) -> int:
    """Run `fn`; a user error (bad config, data, engine) becomes one line on stderr and exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from glmlight.config import format_config_error
    from glmlight.errors import GlmlightError

    try:
        return fn() or 0
    except GlmlightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as e:
        print(format_config_error(e), file=sys.stderr)
        return 2
