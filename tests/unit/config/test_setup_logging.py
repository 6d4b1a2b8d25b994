"""glmlight.run.cli.setup_logging, which every entry point (train, evaluate, export, pipeline) calls: called again in
one process (glmlight.run.train.main run twice, as tests and notebooks do), it leaves one handler, writing to the
stderr of the moment, not one more per call, each bound to the stderr of its own time."""

import io
import logging
import sys

from glmlight.run.cli import setup_logging


def test_calling_it_again_keeps_one_handler_on_the_current_stderr(monkeypatch):
    logger = logging.getLogger("glmlight")
    before = list(logger.handlers)
    try:
        first, second = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging()
        first.close()  # that stderr is gone (a finished test's capture, a closed notebook cell)
        monkeypatch.setattr(sys, "stderr", second)
        setup_logging()
        logging.getLogger("glmlight.probe").info("hello")
        assert len(logger.handlers) == len(before) + 1
        assert second.getvalue() == "INFO glmlight.probe: hello\n"
    finally:
        for h in logger.handlers[:]:
            if h not in before:
                logger.removeHandler(h)
