"""The architecture specs (adaptive_ds/models/spec.py) and the questions the model and its configuration answer for
the trainer and the tools, each checked against what the architecture is written to be."""

import pytest
import torch
from helpers.common import tiny_config
from helpers.own_mlp import GELUMLP, own_mlp_parameters
from torch import nn

from adaptive_ds.flops import training_flops_per_token
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.models.mod import MixtureOfDepths
from adaptive_ds.models.moe import SwiGLU
from adaptive_ds.models.spec import ARCH_SPECS, ArchitectureSpec, architecture_spec, register_architecture
from adaptive_ds.presets import ARCHITECTURES, parameter_counts
from adaptive_ds.training.controller import Knobs


def knobs(**model_side) -> Knobs:
    return Knobs(micro_batch=1, accumulation=1, **model_side)


def test_the_registry_holds_the_architectures_the_settings_know_and_refuses_a_second_registration():
    assert tuple(ARCH_SPECS) == ARCHITECTURES
    with pytest.raises(ValueError, match="'moe' is registered already"):
        register_architecture(ArchitectureSpec("moe"))
    with pytest.raises(ValueError, match="unknown arch 'bogus'; valid choices: dense, moe, mod, hybrid"):
        architecture_spec("bogus")


@pytest.mark.parametrize(("arch", "overrides", "aux_coef", "mod_capacity", "routings"), [
    ("dense", {}, None, None, ("causal",)),
    ("moe", {}, 0.01, None, ("causal",)),
    ("moe", {"moe_balancing": "bias"}, None, None, ("causal",)),  # the aux loss is reported, not trained on
    ("mod", {}, None, 0.5, ("causal", "topk")),
    ("hybrid", {}, 0.01, 0.5, ("causal", "topk")),
])
def test_the_model_names_its_knobs_and_validation_routings(arch, overrides, aux_coef, mod_capacity, routings):
    model = AdaptiveDSForCausalLM(tiny_config(arch, router_aux_loss_coef=0.01, **overrides))
    assert model.default_knobs() == {"aux_coef": aux_coef, "mod_capacity": mod_capacity}
    assert knobs(**model.default_knobs()).mod_capacity == mod_capacity  # the trainer's Knobs take them as they are
    assert model.validation_routings() == routings


def test_apply_knobs_moves_the_loss_coefficient_the_capacity_and_checkpointing_and_leaves_a_none_knob_alone():
    model = AdaptiveDSForCausalLM(tiny_config("hybrid", router_aux_loss_coef=0.01))
    model.apply_knobs(knobs(activation_checkpointing=True, aux_coef=0.05, mod_capacity=0.25))
    blocks = [layer for layer in model.model.layers if isinstance(layer, MixtureOfDepths)]
    assert model.model.gradient_checkpointing and model.router_aux_loss_coef == 0.05
    assert blocks and all(block.capacity == 0.25 for block in blocks)
    model.apply_knobs(knobs())
    assert not model.model.gradient_checkpointing and model.router_aux_loss_coef == 0.05
    assert all(block.capacity == 0.25 for block in blocks)
    assert model.config.router_aux_loss_coef == 0.01  # the saved configuration keeps its own


def test_routing_statistics_keep_the_routing_and_drop_the_logits():
    model = AdaptiveDSForCausalLM(tiny_config("hybrid"))
    out = model(input_ids=torch.randint(2, 64, (2, 8)), labels=torch.randint(2, 64, (2, 8)))
    stats = model.routing_statistics(out)
    assert not hasattr(stats, "logits") and stats.expert_counts is out.expert_counts
    assert stats.aux_loss is out.aux_loss and stats.mod_routing is out.mod_routing
    assert stats.mod_predictor_loss is out.mod_predictor_loss and stats.expert_dropped is out.expert_dropped


@pytest.mark.parametrize(("balancing", "moves"), [("bias", True), ("aux_loss", False)])
def test_after_an_optimizer_step_only_bias_balancing_moves_anything(balancing, moves):
    model = AdaptiveDSForCausalLM(tiny_config("moe", moe_balancing=balancing))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = [model.routing_statistics(model(input_ids=torch.randint(2, 64, (2, 8)))) for _ in range(2)]
    model.after_optimizer_step(stats)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert bool(changed) == moves and all("bias" in k for k in changed)
    dense = AdaptiveDSForCausalLM(tiny_config("dense"))
    dense.after_optimizer_step([dense.routing_statistics(dense(input_ids=torch.randint(2, 64, (1, 4))))])


@pytest.mark.parametrize(("arch", "zero3", "unrouted"), [
    ("dense", False, "dense"), ("moe", True, "moe"), ("mod", False, "dense"), ("hybrid", True, "moe")])
def test_the_configuration_answers_the_tools(arch, zero3, unrouted):
    config = tiny_config(arch, moe_ep_size=2)
    assert config.expert_parallel_size == (2 if arch in ("moe", "hybrid") else 1)
    assert (config.zero3_problem is not None) == zero3
    assert config.unrouted().arch == unrouted and config.arch == arch
    # the FLOPs baseline is the same model with every block on every token: MoD's routed share costs less
    routed, full = (training_flops_per_token(c, 64) for c in (config, config.unrouted()))
    assert (routed < full) == (arch in ("mod", "hybrid")) and routed <= full


def test_only_a_plain_swiglu_model_upcycles_into_experts():
    dense, moe, mod, hybrid = (ARCH_SPECS[name] for name in ("dense", "moe", "mod", "hybrid"))
    assert dense.upcycles_into(moe) and dense.upcycles_into(hybrid)
    assert not dense.upcycles_into(mod) and not dense.upcycles_into(dense)
    assert not moe.upcycles_into(hybrid) and not mod.upcycles_into(hybrid)
    assert not ArchitectureSpec("own", mlp=nn.Identity).upcycles_into(moe)  # its MLPs are not SwiGLU experts


@pytest.fixture
def registered():
    """Registers a spec for the test, and removes it after."""
    names = []

    def register(spec):
        names.append(register_architecture(spec).name)
        return spec
    yield register
    for name in names:
        ARCH_SPECS.pop(name)


def test_an_architecture_with_its_own_mlp_builds_it_and_counts_it(registered):
    registered(ArchitectureSpec("relu", mlp=GELUMLP, mlp_parameters=own_mlp_parameters))
    config = tiny_config("relu")
    model = AdaptiveDSForCausalLM(config)
    assert [type(layer.mlp) for layer in model.model.layers] == [GELUMLP] * config.num_hidden_layers
    assert parameter_counts(config).total == sum(p.numel() for p in model.parameters())
    assert model.default_knobs() == {"aux_coef": None, "mod_capacity": None} and config.zero3_problem is None
    assert type(AdaptiveDSForCausalLM(tiny_config("dense")).model.layers[0].mlp) is SwiGLU


@pytest.mark.parametrize(("arch", "overrides", "layers"), [
    ("dense", {}, 0), ("mod", {}, 0), ("moe", {}, 4), ("moe", {"moe_layer_interval": 2}, 2), ("hybrid", {}, 4)])
def test_num_moe_layers_counts_the_layers_that_hold_experts(arch, overrides, layers):
    config = tiny_config(arch, num_hidden_layers=4, **overrides)
    model = AdaptiveDSForCausalLM(config)
    assert config.num_moe_layers == layers == sum(
        any(".experts." in name for name, _ in layer.named_parameters()) for layer in model.model.layers)


def test_an_architecture_registered_later_counts_everywhere_the_architectures_are_asked(registered):
    """Nothing holds a table of the architectures made at import: a second MoE architecture registered now is
    listed, upcycled with its top-1 renormalised, and an unknown arch is refused in one line."""
    import adaptive_ds.models as models
    from adaptive_ds.models.upcycling import upcycled_settings

    registered(ArchitectureSpec("moe2", moe=True))
    assert models.ARCHITECTURES[-1] == "moe2"
    assert upcycled_settings("dense", "moe2", {"num_experts_per_tok": 1}) == {
        "mod_straight_through": False, "moe_renormalize_top1": True}
    config = tiny_config("dense")
    config.arch = "bogus"
    with pytest.raises(ValueError, match=r"^unknown arch 'bogus'; valid choices: dense, moe, mod, hybrid, moe2$"):
        _ = config.arch_spec
