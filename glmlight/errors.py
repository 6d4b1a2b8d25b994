"""Errors a user can act on. `scripts/train.py` prints these as one line, no traceback."""


class GlmlightError(Exception):
    """Base class: the message alone tells the user what is wrong and what to do."""


class ConfigError(GlmlightError):
    """A config key that does not exist, a wrong type, or an impossible combination."""


class DataError(GlmlightError):
    """A prompt file or data set that cannot be read (the message names file and line)."""


class EngineError(GlmlightError):
    """An inference engine or server that is missing, refuses us or answers nonsense."""


class AcceleratorUnavailable(GlmlightError):
    """The requested accelerator's runtime is not installed or has no device."""
