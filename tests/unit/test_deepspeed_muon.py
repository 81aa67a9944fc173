"""The torch.compile stand-in that DeepSpeed's Muon module is imported with (adaptive_ds/training/deepspeed_muon.py):
it compiles a function at its first call, once, with the decorator's options, and gives the function's results.
tests/integration/test_deepspeed_muon.py checks that a process building an engine then never imports inductor."""

from __future__ import annotations

import sys

import pytest
import torch
from deepspeed.runtime import compiler

from adaptive_ds.training.deepspeed_muon import deferred_compile, import_muon


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



def test_import_muon_decorates_with_the_stand_in_and_restores_deepspeeds_compile(tmp_path, monkeypatch):
    """A module decorated with DeepSpeed's `compile()` gets the stand-in (nothing compiles at import); after the import,
    and after one that fails, DeepSpeed's `compile()` and `torch.compile` are what they were; a missing module is no
    error, a failing one's error is raised."""
    real, real_torch = compiler.compile, torch.compile
    (tmp_path / "fake_muon.py").write_text(
        "from deepspeed.runtime import compiler\n"
        "@compiler.compile()\n"
        "def update(x):\n"
        "    return x + 1\n")
    (tmp_path / "broken_muon.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_muon("fake_muon")
    fake = sys.modules["fake_muon"]
    assert not hasattr(fake.update, "_torchdynamo_orig_callable")  # not compiled at import
    assert fake.update.__wrapped__(1) == 2
    assert compiler.compile is real and torch.compile is real_torch
    import_muon("no_such_muon_module")  # a DeepSpeed without Muon
    with pytest.raises(RuntimeError, match="broken at import"):
        import_muon("broken_muon")
    assert compiler.compile is real and torch.compile is real_torch
    sys.modules.pop("fake_muon")
