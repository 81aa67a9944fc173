"""The torch.compile stand-in that DeepSpeed's Muon module is imported with (adaptive_ds/training/deepspeed_muon.py):
it compiles a function at its first call, once, with the decorator's options, and gives the function's results.
tests/integration/test_deepspeed_muon.py checks that a process building an engine then never imports inductor."""

from __future__ import annotations

import torch

from adaptive_ds.training.deepspeed_muon import deferred_compile


def _recording_compile(calls):
    def compile_fn(function, **options):
        calls.append(options)
        return lambda *args, **kwargs: ("compiled", function(*args, **kwargs))
    return compile_fn


def test_a_deferred_function_compiles_once_at_its_first_call_with_its_options():
    calls = []
    deferred = deferred_compile(_recording_compile(calls))

    @deferred(fullgraph=True, mode="max-autotune")
    def add(a, b=1):
        """adds"""
        return a + b

    @deferred
    def double(x):
        return 2 * x

    assert calls == []  # nothing compiled at decoration
    assert add(2, b=3) == ("compiled", 5)
    assert add(4) == ("compiled", 5)
    assert double(7) == ("compiled", 14)
    assert calls == [{"fullgraph": True, "mode": "max-autotune"}, {}]  # once each, with the decorator's options
    assert add.__name__ == "add" and add.__doc__ == "adds"


def test_a_deferred_function_through_dynamo_gives_the_eager_result():
    deferred = deferred_compile(torch.compile)

    @deferred(backend="eager", fullgraph=True)
    def scaled(x):
        return torch.tanh(x) * 3 + x.sum()

    torch._dynamo.reset()
    x = torch.randn(5, 4)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(scaled(x), torch.tanh(x) * 3 + x.sum())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1  # dynamo traced it

