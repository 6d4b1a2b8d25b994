"""glmlight: Lightning-style RL post-training for GLM-5-style models."""

from glmlight import accelerators  # noqa: F401  (registers the "npu" accelerator with Lightning)
from glmlight.build import Run, build
from glmlight.sample import Experience, Sample, Status

__version__ = "0.1.0"

__all__ = ["Experience", "Run", "Sample", "Status", "build"]
