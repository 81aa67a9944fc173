"""DeepSpeed's Muon module, imported with its `torch.compile` deferred to first use.

`deepspeed.runtime.zero.muon.original_muon` decorates its Newton-Schulz and update functions with
`deepspeed.runtime.compiler.compile()` (that is, `torch.compile`) as it is imported, and DeepSpeed imports it while it
builds and first steps every ZeRO-1/2 engine (the optimizer check, the gradient averaging, the bf16 optimizer),
whatever the optimizer. `torch.compile` imports inductor's compiler there and then, which every training process pays
for, though no adaptive_ds run uses Muon. `import_muon` imports that module first, with DeepSpeed's `compile()` giving
a stand-in that compiles each decorated function at its first call, with the decorator's own options: the module and
its functions are DeepSpeed's, only the moment of compilation moves, and a run that does train with DeepSpeed's Muon
compiles them when it first steps. Only DeepSpeed's helper is replaced, and only during that import: `torch.compile`
itself is never touched.
"""

from __future__ import annotations

import functools
import importlib
import sys

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


def import_muon(module: str = MUON_MODULE) -> None:
    """Import DeepSpeed's Muon module (`module`), its functions compiled at their first call. Idempotent; nothing where
    it is imported already or this DeepSpeed has no such module; DeepSpeed's `compile()` is restored whatever the
    import does."""
    if module in sys.modules:
        return
    from deepspeed.runtime import compiler

    real = compiler.compile
    compiler.compile = lambda: deferred_compile(real())
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:  # a DeepSpeed without Muon: nothing to defer
        if error.name is None or not module.startswith(error.name):
            raise
    finally:
        compiler.compile = real
