"""Checkpoints written by earlier versions: a model field their identity lacks means what loading that config
means, and a shipped default that moved since refuses them in one line unless the run asks for the old setting."""

import json

import pytest

from adaptive_ds.presets import model_config
from adaptive_ds.training import checkpoint
from adaptive_ds.training.checkpoint import CheckpointError


@pytest.mark.parametrize("arch", ["dense", "mod"])
def test_a_missing_model_field_means_what_loading_that_config_means(arch, tiny_config):
    # A MoD checkpoint from before mod_causal_routing was trained with the predictor: resuming it as the new
    # default (router) would load the wrong modules, so it is refused in one line unless the run says predictor.
    # A dense one has no MoD block: the field does nothing there, and the checkpoint resumes as it is.
    current = {"arch": arch, "model": json.loads(json.dumps(tiny_config(arch).to_dict()))}
    saved = {"arch": arch, "model": {k: v for k, v in current["model"].items()  # written before both fields
                                     if k not in ("mod_causal_routing", "config_version")}}
    completed = checkpoint.with_new_model_fields(saved)
    if arch == "dense":
        checkpoint.check_compatible(completed, current, "ckpt")
        return
    with pytest.raises(CheckpointError, match="model.mod_causal_routing 'predictor' .this run: 'router'."):
        checkpoint.check_compatible(completed, current, "ckpt")
    as_predictor = {**current, "model": {**current["model"], "mod_causal_routing": "predictor"}}
    checkpoint.check_compatible(completed, as_predictor, "ckpt")


def test_a_mod_checkpoint_without_the_capacity_fields_resumes_as_capacity_half_in_every_block():
    # mod shipped with capacity 0.5 in every block until the paper's setting became its default (presets.py
    # VARIANTS): a saved identity that lacks the two fields means that model, so resuming it as today's
    # default is refused in one line, and a run that asks for the old setting resumes it.
    half = {"arch": "mod", "model": json.loads(json.dumps(
        model_config("debug", "mod", 128, mod_capacity=0.5, mod_layer_interval=1).to_dict()))}
    saved = {"arch": "mod", "model": {k: v for k, v in half["model"].items()  # as identities were written then
                                      if k not in ("mod_capacity", "mod_layer_interval", "config_version")}}
    completed = checkpoint.with_new_model_fields(saved)
    assert (completed["model"]["mod_capacity"], completed["model"]["mod_layer_interval"]) == (0.5, 1)
    checkpoint.check_compatible(completed, half, "ckpt")
    default = {"arch": "mod", "model": json.loads(json.dumps(model_config("debug", "mod", 128).to_dict()))}
    with pytest.raises(CheckpointError, match=r"model.mod_capacity 0.5 \(this run: 0.125\)"):
        checkpoint.check_compatible(completed, default, "ckpt")


def test_a_hybrid_checkpoint_of_the_old_top2_default_is_refused_and_resumes_when_asked_for():
    # the hybrid's MoE blocks routed top-2 capacity-limited until top-1 dropless became its default (presets.py
    # VARIANTS): a saved identity records both fields, so today's default refuses it in one line, naming them,
    # and a run that asks for the old routing resumes it.
    old = {"arch": "hybrid", "model": json.loads(json.dumps(
        model_config("debug", "hybrid", 128, num_experts_per_tok=2, moe_drop_tokens=True).to_dict()))}
    default = {"arch": "hybrid", "model": json.loads(json.dumps(model_config("debug", "hybrid", 128).to_dict()))}
    with pytest.raises(CheckpointError, match=r"model.num_experts_per_tok 2 \(this run: 1\); "
                                              r"model.moe_drop_tokens True \(this run: False\)"):
        checkpoint.check_compatible(old, default, "ckpt")
    asked = {"arch": "hybrid", "model": json.loads(json.dumps(model_config(
        "debug", "hybrid", 128, **{"num_experts_per_tok": 2, "moe_drop_tokens": True}).to_dict()))}
    checkpoint.check_compatible(old, asked, "ckpt")


def test_the_loop_reaches_checkpoints_through_three_names():
    """The training loop uses the checkpoint package through the Checkpointer and the run identity's two functions,
    nothing else (a static check of loop.py: every `checkpoint.NAME` it reads but the errors it catches, and no
    `from .checkpoint import`)."""
    import ast

    import adaptive_ds.training.loop as loop_module

    tree = ast.parse(open(loop_module.__file__).read())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "checkpoint"
            and not node.attr.endswith("Error")}
    direct = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
              and node.module.startswith("checkpoint")]
    assert used == {"Checkpointer", "run_identity", "check_resumable"} and not direct, used


def test_a_moe_checkpoint_from_before_an_option_resumes_at_its_default_and_refuses_another(tiny_config):
    # moe_expert_granularity and moe_balancing came after the first MoE checkpoints: such a checkpoint is the model
    # at their defaults (granularity 1, the aux loss), so it resumes at them and a run at granularity 2 (another
    # model) is refused in one line
    current = {"arch": "moe", "model": json.loads(json.dumps(tiny_config("moe").to_dict()))}
    saved = {"arch": "moe", "model": {k: v for k, v in current["model"].items()
                                      if k not in ("moe_expert_granularity", "moe_balancing", "config_version")}}
    completed = checkpoint.with_new_model_fields(saved)
    checkpoint.check_compatible(completed, current, "ckpt")
    finer = {**current, "model": {**current["model"], "moe_expert_granularity": 2}}
    with pytest.raises(CheckpointError, match=r"model.moe_expert_granularity 1 \(this run: 2\)"):
        checkpoint.check_compatible(completed, finer, "ckpt")
