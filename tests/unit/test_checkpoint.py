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


def _checkpointing_outside_the_checkpointer(source: str) -> list[str]:
    """What a module's source reaches of checkpointing other than through a Checkpointer: an import from the
    checkpoint package of anything but the Checkpointer class, a name the package exports used bare or on anything
    but `self.checkpointer` or `Checkpointer`, and the process-wide progress (`distributed.progress`)."""
    import ast

    tree = ast.parse(source)
    exported = set(checkpoint.__all__) - {"Checkpointer"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            module = node.module or ""
            if "checkpoint" in module.split(".") and names != ["Checkpointer"]:
                found.append(f"from {module} import {', '.join(names)}")
            elif "checkpoint" in names:
                found.append(f"from {module or '.'} import checkpoint")
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if "checkpoint" in a.name.split(".")]
        elif isinstance(node, ast.Name) and node.id in exported:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in exported and \
                ast.unparse(node.value) not in ("self.checkpointer", "Checkpointer"):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Attribute) and node.attr == "progress" and ast.unparse(node.value) == "distributed":
            found.append("distributed.progress")
    return found


def test_the_loop_reaches_checkpointing_through_the_checkpointer_only():
    """training/loop.py saves, resumes, rolls back and stops through one object: it imports the Checkpointer class
    from the checkpoint package and nothing else, calls the package's functions only as the checkpointer's methods,
    and keeps no process-wide progress (a static check of its source)."""
    import adaptive_ds.training.loop as loop_module

    assert _checkpointing_outside_the_checkpointer(open(loop_module.__file__).read()) == []


def test_the_static_check_finds_each_way_around_the_checkpointer():
    """The check above on sources that reach checkpointing each way it forbids (the loop's own before the
    Checkpointer owned resume and stop did all of them), and on one that does not."""
    around = """
from . import checkpoint
from .checkpoint import Checkpointer, save
from .checkpoint.storage import latest_tag
import adaptive_ds.training.checkpoint.manager
saved = checkpoint.check_resumable(output_dir, tag, identity)
tag = latest_tag(output_dir)
self.engine.restore(1)
distributed.progress.step = 3
"""
    assert _checkpointing_outside_the_checkpointer(around) == [
        "from . import checkpoint", "from checkpoint import Checkpointer, save", "from checkpoint.storage import "
        "latest_tag", "import adaptive_ds.training.checkpoint.manager", "checkpoint.check_resumable", "latest_tag",
        "self.engine.restore", "distributed.progress"]
    through = """
from .checkpoint import Checkpointer
resume = Checkpointer.open(output_dir, Checkpointer.run_identity(settings, 1, 8, config))
self.checkpointer.restore()
self.checkpointer.maybe_save(step, healthy)
"""
    assert _checkpointing_outside_the_checkpointer(through) == []


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
