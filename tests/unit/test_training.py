"""Training's pieces without the engine: weight-decay and MoE param groups, the learning-rate and MoD capacity
schedules, the phase clock, and DeepSpeed's op builds with the environment's ninja."""

import os
import sys

import pytest

from adaptive_ds.training import moe_adapter
from adaptive_ds.training.optim import parameter_groups, warmup_cosine


def test_weight_decay_skips_norms_and_experts_get_moe_groups(tiny_config):
    from adaptive_ds.models import AdaptiveDSForCausalLM

    model = AdaptiveDSForCausalLM(tiny_config("moe"))
    moe_adapter.prepare(model)
    groups = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in groups:
        for p in group["params"]:
            if p.ndim < 2:
                assert group["weight_decay"] == 0.0
            assert group.get("moe", False) == ("deepspeed_experts" in names[id(p)])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_building_param_groups_changes_nothing_in_the_model_and_needs_it_prepared(tiny_config):
    """Preparing the model for DeepSpeed is its own step (`moe_adapter.prepare`, where the engine is built); the param
    groups only read the model."""
    from adaptive_ds.models import AdaptiveDSForCausalLM

    model = AdaptiveDSForCausalLM(tiny_config("moe"))

    def layout():  # every module object, and every parameter's object and storage
        return ([(name, id(module)) for name, module in model.named_modules()],
                [(name, id(p), p.data_ptr(), p.storage_offset()) for name, p in model.named_parameters()])

    before = layout()
    with pytest.raises(AssertionError, match="moe_adapter.prepare"):
        parameter_groups(model, 0.1)
    assert layout() == before
    moe_adapter.prepare(model)
    before = layout()
    parameter_groups(model, 0.1)
    assert layout() == before
    dense = AdaptiveDSForCausalLM(tiny_config("dense"))  # no MoE layer: nothing to prepare
    assert sum(len(g["params"]) for g in parameter_groups(dense, 0.1)) == len(list(dense.parameters()))


def test_mod_capacity_anneals_from_one_to_the_target():
    from adaptive_ds.training.controller import mod_capacity_at

    assert [mod_capacity_at(s, 0.5, 10) for s in (0, 5, 10, 50)] == [1.0, 0.75, 0.5, 0.5]
    assert mod_capacity_at(0, 0.5, 0) == 0.5


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    f = warmup_cosine(10, 110, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


class _FakeClock:
    """time.perf_counter and time.time for PhaseClock: they move only when the test advances them."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_the_phase_clock_charges_nested_phases_to_the_inner_one(monkeypatch):
    from adaptive_ds.training import metrics
    from adaptive_ds.training.metrics import PhaseClock

    clock = _FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    phases = PhaseClock()
    clock.advance(1.0)  # no phase: "other"
    with phases.phase("setup"):
        clock.advance(2.0)
        with phases.phase("data"):
            clock.advance(5.0)
            with phases.phase("train"):
                clock.advance(7.0)
            clock.advance(0.5)
        clock.advance(0.25)
    with phases.phase("data"):  # a phase opened again adds to its total
        clock.advance(3.0)
    assert phases.seconds == {"setup": 2.25, "data": 8.5, "train": 7.0, "checkpoint": 0.0, "eval": 0.0}
    assert phases.breakdown() == {**phases.seconds, "other": 1.0, "total": 18.75}
    with pytest.raises(ValueError, match="unknown phase 'io'; one of setup, data, train, checkpoint, eval"):
        with phases.phase("io"):
            pass
    assert phases.breakdown()["total"] == 18.75


def test_the_phase_clock_counts_start_up_as_setup(monkeypatch):
    from adaptive_ds.training import metrics
    from adaptive_ds.training.metrics import PhaseClock

    clock = _FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    monkeypatch.setattr(metrics.time, "time", lambda: 1000.0)  # epoch seconds now: the process began 5 s ago
    phases = PhaseClock(process_started=995.0)
    clock.advance(2.0)
    assert phases.seconds["setup"] == 5.0 and phases.breakdown() == {**phases.seconds, "other": 2.0, "total": 7.0}


def test_every_process_builds_deepspeeds_ops_with_the_environments_ninja(monkeypatch):
    """Two ninjas (pip's in the virtualenv, a system one) record builds differently: a process finding the other
    one rebuilds DeepSpeed's shm op. Ours put the environment's first, however they were started."""
    from adaptive_ds.distributed import use_this_environments_ninja

    bin_dir = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(bin_dir, "ninja"))  # pip's ninja, a DeepSpeed dependency
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_this_environments_ninja()
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin:/bin"
    use_this_environments_ninja()  # already first: unchanged
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin:/bin"


def test_an_arch_list_with_arch_specific_entries_is_one_deepspeeds_builder_reads(monkeypatch):
    """CUDA images set TORCH_CUDA_ARCH_LIST to entries such as "9.0a", which DeepSpeed's FusedAdam build cannot
    parse (seen on an H200 image); ours take the plain capability and leave readable lists alone."""
    import importlib

    from adaptive_ds.distributed import arch_list_deepspeed_can_read

    builder = importlib.import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder()
    builder.jit_mode = True  # as DeepSpeed's jit_load sets it before reading the list
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;10.0f+PTX;9.0")
    with pytest.raises(ValueError, match="invalid literal"):
        builder.compute_capability_args()
    arch_list_deepspeed_can_read()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
    builder.compute_capability_args()  # reads it
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6 9.0+PTX")
    arch_list_deepspeed_can_read()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.6 9.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    arch_list_deepspeed_can_read()
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ


def test_the_summary_line_counts_tokens_and_seconds_over_one_span():
    """After a resume the tokens are the whole run's and the seconds this start's: the line says how many of the
    tokens this start trained in them (600 steps of 4,096 tokens, resumed at 400: 819,200 in its 426 s)."""
    from adaptive_ds.training.loop import _describe

    summary = {"validation_loss": 2.5, "final_perplexity": 12.18, "tokens_seen": 2_457_600, "wall_time_s": 426.2,
               "steps": 600, "resumed_from_step": 400}
    assert _describe(summary) == ("validation loss 2.5000 (perplexity 12.180) after 2,457,600 tokens, 819,200 of "
                                  "them in this start's 426 s (resumed at step 400)")
    assert _describe({**summary, "resumed_from_step": 0}).endswith("after 2,457,600 tokens in 426 s")


def test_a_negative_captured_share_says_what_it_means():
    from adaptive_ds.training.loop import _describe

    summary = {"validation_loss": 4.32, "final_perplexity": 75.1, "tokens_seen": 16_384, "wall_time_s": 50,
               "steps": 4, "resumed_from_step": 0, "entropy_floor": 1.4876, "unigram_entropy": 4.1696,
               "captured": -0.056}
    assert _describe(summary).endswith("captured -5.6% of the learnable structure (below 0: the loss is still above "
                                       "the unigram entropy, what knowing only the token frequencies reaches)")
    assert _describe({**summary, "captured": 0.5}).endswith("captured 50.0% of the learnable structure")
