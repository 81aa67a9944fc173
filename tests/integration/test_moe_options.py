"""A fine-grained, shared, bias-balanced MoE run trains, checkpoints and resumes with its routing bias."""


import pytest
import torch
from transformers import AutoModelForCausalLM

from adaptive_ds.models.moe import MoEFeedForward
from adaptive_ds.training import train
from adaptive_ds.training.validation import evaluate

FINE = dict(moe_expert_granularity=2, moe_shared_experts=1)  # 4 x 2 = 8 experts of width 32, top-4, shared 32


class _BiasRecorder:
    """Trainer hooks: before each step, the routing-bias tally of every MoE layer and the routing window's
    cumulative expert counts (with log_steps past max_steps the window spans the whole run); before the first step,
    the untrained model's loss on the run's held-out batches (`validation_batches`: the run's micro-batch and
    eval_batches)."""

    def __init__(self, validation_batches: tuple[int, int]):
        self.tally, self.counts, self.aux_coef, self.untrained_loss = {}, {}, None, None
        self.validation_batches = validation_batches

    def before_step(self, trainer, step):
        if step == 1:
            batches = trainer.data.validation_batches(*self.validation_batches)
            self.untrained_loss = evaluate(trainer.engine, batches).loss
        layers = [m for m in trainer.engine.module.modules() if isinstance(m, MoEFeedForward)]
        self.tally[step] = torch.stack([m.routing_bias_steps.clone() for m in layers])
        window = trainer.metrics.routing.expert_counts
        self.counts[step] = None if window is None else window.clone()
        self.aux_coef = trainer.controller.knobs.aux_coef

    def before_micro_batch(self, trainer, step, index, micro_batch):
        pass


@pytest.mark.slow
def test_fine_grained_shared_bias_run_trains_checkpoints_and_resumes_with_its_bias(tmp_path, tiny_ds_config):
    model = {**FINE, "moe_balancing": "bias", "moe_bias_update_rate": 0.01, "moe_drop_tokens": False}
    out = tmp_path / "run"

    def run(max_steps):
        config = tiny_ds_config(2, 2, max_steps=max_steps, save_steps=2, log_steps=100, eval_batches=1,
                                model=model)
        hooks = _BiasRecorder(validation_batches=(2, 1))
        summary = train(["--ds_config", config, "--arch", "moe", "--output_dir", str(out)], hooks=hooks)
        return summary, hooks

    summary, first = run(3)
    assert first.aux_coef is None  # the controller has no aux-loss coefficient to adjust
    for step in (2, 3):  # each step moved every layer's bias by sign(mean load - load), loads of 2 micro-batches
        load = first.counts[step] - (first.counts[step - 1] if first.counts[step - 1] is not None else 0)
        expected = torch.sign(load.mean(1, keepdim=True) - load).long()
        assert torch.equal(first.tally[step] - first.tally[step - 1], expected), step
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    tally = torch.stack([layer.mlp.routing_bias_steps for layer in final.model.layers])
    assert tally.abs().sum() > 0 and final.config.moe_shared_experts == 1
    # three steps take the held-out loss well below the same model's before training (about ln 128, a uniform guess)
    assert first.untrained_loss > 4.6 and summary["validation_loss"] < first.untrained_loss - 0.3

    summary, resumed = run(4)
    assert summary["resumed_from_step"] == 3
    assert torch.equal(resumed.tally[4], tally)  # the bias came back with the checkpoint
