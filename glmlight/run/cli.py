"""What the scripts share: logging set-up and one-line errors."""

from __future__ import annotations

import logging
import sys
from typing import Callable


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

    from glmlight.config.schema import format_config_error
    from glmlight.errors import GlmlightError

    try:
        return fn() or 0
    except GlmlightError as e:
        print(one_line(e), file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as e:
        print(format_config_error(e), file=sys.stderr)
        return 2
