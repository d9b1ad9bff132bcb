"""forerun: lossless speculative decoding in one PyTorch engine."""

from forerun.errors import ForerunError
from forerun.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["ForerunError", "SamplingParams", "__version__"]
