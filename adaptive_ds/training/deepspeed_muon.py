"""DeepSpeed's Muon module, imported with its `torch.compile` deferred to first use.

`deepspeed.runtime.zero.muon.original_muon` decorates its Newton-Schulz and update functions with `torch.compile` as
it is imported, and DeepSpeed imports it while it builds every ZeRO-1/2 engine (the optimizer check, the gradient
averaging, the bf16 optimizer), whatever the optimizer. `torch.compile` imports inductor's compiler there and then,
which every training process's start pays for, though no adaptive_ds run uses Muon. `import_muon` imports that module
first, with each decorated function compiled at its first call instead, with the decorator's own options: the module
and its functions are DeepSpeed's, only the moment of compilation moves, and a run that does train with DeepSpeed's
Muon compiles them when it first steps.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch

MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def deferred_compile(compile_fn):
    """A stand-in for `compile_fn` (torch.compile) that compiles each function it decorates on the function's first
    call, with the options it was decorated with, and calls the compiled function from then on."""

    def decorate(model=None, **options):
        if model is None:  # @torch.compile(mode=...) form
            return lambda function: decorate(function, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return decorate


def import_muon() -> None:
    """Import DeepSpeed's Muon module, its functions compiled at their first call (idempotent; nothing where this
    DeepSpeed has no such module, or it is already imported)."""
    if MUON_MODULE in sys.modules:
        return
    real = torch.compile
    torch.compile = deferred_compile(real)
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon: nothing to defer
        pass
    finally:
        torch.compile = real
