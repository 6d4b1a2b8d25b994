"""Shared pieces of the command-line entry points: logging set-up and one-line errors."""

from __future__ import annotations

import logging
import sys
from typing import Callable


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
