"""The planner's advice: each piece a config that runs when planned again (fits the GPU and the usual host, never
ZeRO-3 for DeepSpeed MoE, taken by training's own validation), the least change of its kind."""

import copy
import json

import pytest
from helpers.common import ROOT

from adaptive_ds.hardware import DEVICES
from adaptive_ds.tools.plan import main, plan_ds_config
from adaptive_ds.tools.plan_advice import advise
from adaptive_ds.training.arguments import parse


def _ds(name):
    return json.loads((ROOT / "ds_configs" / name).read_text())


def _runs_on_a_usual_host(p, gpu, host_memory_gib=None):
    """Fits the GPU, and its offloaded optimizer states fit the host RAM per GPU of the usual instance (or of the
    larger host an advice names)."""
    return p.fits and p.cpu_states_gib <= (host_memory_gib or DEVICES[gpu].host_memory_gib)


# (preset, arch, GPU, shipped ds_config, GPUs): none runs as configured
DOES_NOT_RUN = [
    ("b1", "moe", "t4", "b1_t4.json", 1),
    ("b1", "hybrid", "t4", "b1_t4.json", 1),
    ("b7", "moe", "a100", "b1_a100.json", 1),
    ("b1", "moe", "a100", "b1_a100.json", 1),
    ("b7", "dense", "t4", "b1_t4.json", 1),
    ("b1", "dense", "t4", "b1_t4.json", 1),  # fits the GPU, not the usual host: a larger host runs it
    ("b7", "moe", "h100", "b7_8gpu.json", 8),  # ZeRO-3, which DeepSpeed MoE does not run
]


@pytest.mark.parametrize("preset, arch, gpu, name, gpus", DOES_NOT_RUN)
def test_each_advice_is_a_config_that_runs_when_planned_again(preset, arch, gpu, name, gpus, tmp_path):
    config = _ds(name)
    base = plan_ds_config(preset, arch, gpu, config, gpus=gpus)
    assert not (_runs_on_a_usual_host(base, gpu) and config["zero_optimization"]["stage"] < 3)
    advice = advise(preset, arch, gpu, config, gpus=gpus)
    assert advice
    for item in advice:
        block = item.ds_config["adaptive_ds"]
        # planned again from the config alone: its block names the model, its batch sizes the number of GPUs
        again = plan_ds_config(block["preset"], block["arch"], gpu, item.ds_config,
                               host_memory_gib=item.host_memory_gib)
        assert again.gpus == item.gpus and _runs_on_a_usual_host(again, gpu, item.host_memory_gib), item.text
        if item.host_memory_gib is not None:  # a larger host: the one thing that did not fit was the host's RAM
            assert base.fits and item.host_memory_gib > DEVICES[gpu].host_memory_gib and item.ds_config == config
        if arch in ("moe", "hybrid"):  # DeepSpeed MoE does not run under ZeRO-3
            assert item.ds_config["zero_optimization"]["stage"] <= 2 and "ZeRO-3 across" not in item.text, item.text
            assert item.gpus % item.ds_config["adaptive_ds"].get("model", {}).get("moe_ep_size", 1) == 0
        path = tmp_path / "advised.json"
        path.write_text(json.dumps(item.ds_config))
        parse(["--ds_config", str(path)], world_size=item.gpus)  # training takes it on that many processes


def _model(item):
    return item.ds_config["adaptive_ds"].get("model", {})


def _regrouped(config, gpus):
    """`config` on `gpus` GPUs, its global batch of 256 kept by the accumulation."""
    config = copy.deepcopy(config)
    config["gradient_accumulation_steps"] = 256 // (config["train_micro_batch_size_per_gpu"] * gpus)
    return config


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_a_moe_gets_expert_parallelism_on_the_fewest_gpus_that_fit(arch):
    """On a host of 24 GiB per GPU (b1_t4.json pins its offload and accumulates: on the usual 16 GiB no expert-parallel
    group fits)."""
    host = {"host_memory_gib": 24.0, "host_detail": "--host_ram_gib 24.0 on each machine of 1 GPU"}
    advice = advise("b1", arch, "t4", _ds("b1_t4.json"), gpus=1, **host)
    parallel = [a for a in advice if _model(a).get("moe_ep_size", 1) > 1]
    assert len(parallel) == 1
    n = _model(parallel[0])["moe_ep_size"]
    assert parallel[0].gpus == n and parallel[0].ds_config["zero_optimization"]["stage"] == 2  # the config's stage
    assert f"across {n} GPUs" in parallel[0].text
    for fewer in (d for d in (1, 2, 4, 8) if d < n):  # each smaller expert-parallel group, by hand: too small
        config = _regrouped(parallel[0].ds_config, fewer)
        config["adaptive_ds"]["model"]["moe_ep_size"] = fewer
        assert not _runs_on_a_usual_host(plan_ds_config("b1", arch, "t4", config), "t4", 24.0), fewer


def test_fewer_or_finer_experts_name_the_most_experts_that_fit():
    advice = advise("b1", "moe", "a100", _ds("b1_a100.json"), gpus=1)
    fewer = [a for a in advice if _model(a).get("num_local_experts", 8) < 8
             and _model(a).get("moe_expert_granularity", 1) == 1]
    finer = [a for a in advice if _model(a).get("moe_expert_granularity", 1) > 1]
    assert len(fewer) == len(finer) == 1
    experts = _model(fewer[0])["num_local_experts"]
    one_more = copy.deepcopy(fewer[0].ds_config)
    one_more["adaptive_ds"]["model"]["num_local_experts"] = experts + 1
    assert not _runs_on_a_usual_host(plan_ds_config("b1", "moe", "a100", one_more), "a100")
    model = _model(finer[0])
    assert model["num_local_experts"] * model["moe_expert_granularity"] == 8  # as many routed experts, each narrower
    assert model["num_local_experts"] <= experts


def test_a_dense_model_that_needs_more_gpus_gets_zero_3_on_the_fewest():
    advice = advise("b7", "dense", "t4", _ds("b1_t4.json"), gpus=1)
    sharded = [a for a in advice if a.ds_config["zero_optimization"]["stage"] == 3]
    assert len(sharded) == 1 and sharded[0].gpus > 1 and f"ZeRO-3 across {sharded[0].gpus} GPUs" in sharded[0].text
    micro = sharded[0].ds_config["train_micro_batch_size_per_gpu"]
    smaller = max(d for d in range(1, sharded[0].gpus) if 256 % (micro * d) == 0)  # the next GPU count that divides
    config = _regrouped(sharded[0].ds_config, smaller)
    assert not _runs_on_a_usual_host(plan_ds_config("b7", "dense", "t4", config), "t4")


def test_a_plan_that_fits_gets_no_advice(capsys):
    config = _ds("b1_a100.json")
    assert _runs_on_a_usual_host(plan_ds_config("b1", "dense", "a100", config), "a100")
    assert advise("b1", "dense", "a100", config) == []
    main(["--preset", "b1", "--gpu", "a100", "--ds_config", str(ROOT / "ds_configs" / "b1_a100.json")])
    out = capsys.readouterr().out
    assert "-> fits" in out and out.count("not a measurement") == 1


def test_cli_advice_for_a_moe_names_what_runs_and_the_host_memory_it_needs(capsys):
    main(["--preset", "b1", "--arch", "moe", "--gpu", "t4", "--ds_config", str(ROOT / "ds_configs" / "b1_t4.json"),
          "--host_ram_gib", "24"])
    out = capsys.readouterr().out
    assert "raise the ZeRO stage" not in out and "ZeRO-3" not in out and out.count("not a measurement") == 1
    assert "expert parallelism across 8 GPUs (moe_ep_size 8, 8 data-parallel ranks, ZeRO stage 2)" in out
    # the 158.3 GiB the configured offload needs (18 bytes for each of 6.43B parameters, the accumulation buffers and
    # a gradient buffer, pinned), beside the host given
    assert "158.3 GiB of CPU RAM" in out and "of the 24 GiB per GPU of the host given" in out


def test_b1_on_a_t4_needs_only_a_larger_host_than_the_smallest_t4_instance():
    """b1_t4.json fits the T4 itself; its offloaded optimizer (31.0 GiB pinned, with its accumulation buffers) does not
    fit the 16 GiB of the smallest T4 instance. The first advice keeps the config and names the RAM: the whole GiB
    above the need."""
    config = _ds("b1_t4.json")
    base = plan_ds_config("b1", "dense", "t4", config)
    assert base.fits and not base.runs and 31 < base.cpu_states_gib < 32
    first = advise("b1", "dense", "t4", config)[0]
    assert first.ds_config == config and first.gpus == 1 and first.host_memory_gib == 32
    assert first.text.startswith("a host with at least 32 GiB of CPU RAM per GPU (the usual t4 host has 16)")
    assert plan_ds_config("b1", "dense", "t4", config, host_memory_gib=31.0).runs is False  # 31.02 needed


def test_a_moe_at_zero_3_is_advised_stage_2_for_the_reason_its_spec_gives_and_a_dense_model_no_expert_options():
    advice = advise("b7", "moe", "h100", _ds("b7_8gpu.json"), gpus=8)  # a ZeRO-3 config
    assert advice and all("ZeRO stage 2 (DeepSpeed MoE does not run under ZeRO-3)" in a.text for a in advice)
    dense = advise("b1", "dense", "t4", _ds("b1_t4.json"), gpus=1)
    assert dense and not any("experts" in a.text or "moe_ep_size" in a.text for a in dense)


def test_the_advice_respects_the_host_ram_given():
    """b1 moe on a T4: expert parallelism over 8 GPUs keeps 22.6 GiB per GPU in host RAM (pinned, at accumulation 8),
    more than the usual host's 16 and within a 24 GiB host's, where the advice offers it; every advice it keeps for
    the host given fits that host when planned again."""
    config, host = _ds("b1_t4.json"), {"host_memory_gib": 24.0, "host_detail": "--host_ram_gib 24.0 on each machine "
                                                                                "of 1 GPU"}
    usual = advise("b1", "moe", "t4", config)
    assert usual and not any("expert parallelism" in a.text for a in usual)
    given = advise("b1", "moe", "t4", config, **host)
    assert any("expert parallelism across 8 GPUs" in a.text and 16 < a.plan.cpu_states_gib <= 24 for a in given)
    for item in given:
        block = item.ds_config["adaptive_ds"]
        again = plan_ds_config(block["preset"], block["arch"], "t4", item.ds_config, **host)
        assert again.runs and again.cpu_states_gib <= 24 and "of the host given" in item.text, item.text
