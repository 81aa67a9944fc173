"""Training through the DeepSpeed engine.

Importing the package imports neither the training loop nor torch: `train` is imported from training/loop.py on first
use (PEP 562), so that the command line is checked before torch and DeepSpeed are imported (training/__main__.py).
"""

import importlib

from .arguments import ConfigError

__all__ = ["ConfigError", "train"]


def __getattr__(name: str):
    if name == "train":
        return importlib.import_module(".loop", __name__).train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
