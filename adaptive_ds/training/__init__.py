"""Training through the DeepSpeed engine."""

from .arguments import ConfigError
from .loop import train

__all__ = ["ConfigError", "train"]
