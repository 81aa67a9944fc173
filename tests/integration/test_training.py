"""End-to-end runs through the real DeepSpeed engine on CPU (gloo)."""

import json
import math
import os
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers.common import DEBUG_CPU, ROOT, free_port, write_ds_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from adaptive_ds.export.convert import main as export_main
from adaptive_ds.models import ARCHITECTURES
from adaptive_ds.training import train


def _tiny_ds_config(tmp_path, micro=4, accum=2, **block):
    return write_ds_config(tmp_path, micro, accum,
                           **{"warmup_steps": 2, "log_steps": 2, "eval_batches": 2, **block})


def _read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_writes_the_output_contract(arch, tmp_path):
    out = tmp_path / "run"
    # MoD at capacity 0.5 in every block (mod ships with the paper's setting): the figures below are for it
    half = ["--model", '{"mod_capacity": 0.5, "mod_layer_interval": 1}'] if arch in ("mod", "hybrid") else []
    summary = train(["--ds_config", _tiny_ds_config(tmp_path), "--arch", arch, "--output_dir", str(out), *half])
    metrics = _read_metrics(out)
    assert [m["step"] for m in metrics] == [2, 4]
    for m in metrics:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(m) and math.isfinite(m["loss"])
        if arch in ("moe", "hybrid"):
            moe = m["moe"]
            # 2 micro-batches x 4 x 256 tokens per step, 2 steps a window, every layer (MoD halves it); moe routes
            # top-2, the hybrid top-1 (its default)
            tokens = 2 * 2 * 4 * 256 * (0.5 if arch == "hybrid" else 1.0)
            top_k = 1 if arch == "hybrid" else 2
            assert sum(moe["tokens_per_expert"]) == top_k * tokens * 4
            if arch == "hybrid":
                assert moe["dropped_fraction"] == 0  # dropless
            assert 0 < moe["load_balance"] <= 1 and 0 <= moe["dropped_fraction"] < 1
            assert moe["z_loss"] > 0 and moe["aux_loss"] > 0 and isinstance(moe["dead_experts"], list)
        if arch in ("mod", "hybrid"):
            assert m["mod"]["skip_rate"] == pytest.approx(0.5)
            assert 0.5 < m["mod"]["flops_reduction"] < 0.6  # half the matmuls, a quarter of the attention
            assert 0 <= m["mod"]["predictor_accuracy"] <= 1 and m["mod"]["capacity"] == 0.5
    written = json.loads((out / "summary.json").read_text())
    assert ("validation_loss_topk_routing" in written) == (arch in ("mod", "hybrid"))
    assert written == summary
    for key in ("train_loss", "validation_loss", "final_perplexity", "entropy_floor", "tokens_seen",
                "wall_time_s", "peak_memory", "total_parameters", "active_parameters", "preset", "arch"):
        assert key in written
    assert written["arch"] == arch and written["tokens_seen"] == 4 * 4 * 2 * 256
    assert written["final_perplexity"] == pytest.approx(math.exp(written["validation_loss"]))
    # every phase ran, and the phases (with "other") account for the whole wall time
    phases = written["time_breakdown_s"]
    assert all(phases[p] > 0 for p in ("setup", "data", "train", "checkpoint", "eval"))
    assert phases["other"] >= 0 and sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"])
    assert written["wall_time_s"] == phases["total"]
    assert written["training_tokens_per_s"] == pytest.approx(written["tokens_seen"] / phases["train"])
    assert 0 < metrics[0]["elapsed_s"] < metrics[1]["elapsed_s"] < phases["total"]
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.arch == arch
    assert sum(p.numel() for p in model.parameters()) == written["total_parameters"]


def test_the_embedded_corpus_is_learned_well_below_the_unigram_entropy(tmp_path):
    out = tmp_path / "run"
    path = _tiny_ds_config(tmp_path, micro=8, accum=1, max_steps=80, warmup_steps=10, log_steps=40,
                           eval_batches=4)
    summary = train(["--ds_config", path, "--arch", "dense", "--output_dir", str(out)])
    # 164k tokens: the model must capture most of the structure above token frequencies, not just drift (it reached
    # a validation loss of 1.72, 91% captured, where the bounds ask below 2.67 and above 60%).
    assert summary["validation_loss"] < summary["unigram_entropy"] - 1.5
    assert summary["captured"] > 0.6


def test_tensorboard_events_and_the_loss_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(["--ds_config", _tiny_ds_config(tmp_path, eval_steps=2), "--arch", "hybrid", "--output_dir", str(out),
           "--report_to", "tensorboard"])
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "lr", "tokens_per_s", "validation_loss", "moe/load_balance", "mod/skip_rate"} <= set(tags)
    logged = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(logged)
    assert [e.step for e in events.Scalars("validation_loss")] == [2, 4]
    # a well-formed SVG: the train curve a point per logged step, the two validations (the final one at step 4 in
    # place of the logged one), the embedded corpus's entropy floor
    chart = list(ET.parse(out / "loss.svg").getroot().iter())
    drawn = [(e.tag.split("}")[1], e.get("class")) for e in chart]
    (curve,) = [e for e in chart if e.get("class") == "train"]
    assert len(curve.get("points").split()) == len(logged)
    assert drawn.count(("circle", "validation")) == 2 and ("line", "entropy-floor") in drawn


def test_capacity_schedule_reaches_the_model(tmp_path):
    out = tmp_path / "run"
    train(["--ds_config", _tiny_ds_config(tmp_path, mod_capacity_warmup_steps=4, eval_steps=1), "--arch", "mod",
           "--variant", "mod:half", "--output_dir", str(out)])  # toward capacity 0.5, in every block
    windows = [m["mod"] for m in _read_metrics(out) if "mod" in m]
    capacities = [m["capacity"] for m in windows]
    skips = [m["skip_rate"] for m in windows]
    assert capacities == [0.875, 0.625] and skips[0] < skips[1] < 0.5
    # validation routes every token at step 1's capacity 1.0, by the router's sign below it (docs/architectures.md)
    shares = {m["step"]: m["validation_causal_routed_share"] for m in _read_metrics(out)}
    assert shares[1] == 1.0 and all(0 < shares[step] < 1 for step in (2, 3, 4)), shares


def _step_losses(tmp_path, name, micro, accum, hooks=None):
    config = write_ds_config(tmp_path, micro, accum, max_steps=6, log_steps=1, warmup_steps=2)
    out = tmp_path / name
    train(["--ds_config", config, "--output_dir", str(out)], hooks=hooks)
    return [m["loss"] for m in _read_metrics(out)]


@pytest.mark.slow
def test_a_step_trains_the_same_whatever_its_split_into_micro_batches(tmp_path):
    """The embedded corpus pads every block, so micro-batches hold unequal numbers of target tokens: only a loss
    normalised over the whole step's targets makes these three runs of 16 rows per step one and the same. Split over
    ranks as well (the normalising count summed over them): every 2-process run that is held to a one-process run of
    the same global batch, on this corpus, to 1e-5 (tests/integration/test_layout_matrix.py,
    test_torchrun_restarts.py, test_stop_request.py)."""
    from helpers.faults import Faults

    whole = _step_losses(tmp_path, "16x1", 16, 1)
    assert _step_losses(tmp_path, "4x4", 4, 4) == pytest.approx(whole, rel=2e-5)
    halved = Faults(oom_micro_batch_above=8, oom_from_step=5, oom_at_micro_index=0)
    assert _step_losses(tmp_path, "16x1-oom", 16, 1, hooks=halved) == pytest.approx(whole, rel=2e-5)
    assert ("oom", 5) in halved.fired


@pytest.mark.slow
def test_the_deepspeed_launchers_shared_memory_is_returned_when_the_run_ends(run_command):
    """DeepSpeed's CPU backend gives each process of a one-machine world under its launcher a 66 MB segment in
    /dev/shm and never removes it. Each process maps both (its own and its peer's) with their names already gone,
    so nothing is left behind when the run ends, however it ends."""
    port = free_port()
    result = run_command(["deepspeed", "--master_port", str(port), "--num_gpus", "2", "tests/helpers/shm_segments.py"],
                         timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"rank"')),
                   key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["made"] for r in ranks)
    # DeepSpeed's names (ops/csrc/cpu/comm/shm.cpp): user, rendezvous address and port, rank
    names = [f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}" for rank in (0, 1)]
    for rank in ranks:
        assert rank["mapped"] == [f"{name} (deleted)" for name in names], rank
    assert not any(os.path.exists(name) for name in names)


@pytest.mark.slow
def test_two_process_expert_parallel_run_with_the_deepspeed_launcher(tmp_path, run_command):
    out = tmp_path / "run"
    result = run_command(["deepspeed", "--num_gpus", "2", "launchers/train.py", "--ds_config",
                          _tiny_ds_config(tmp_path, max_steps=6), "--arch", "moe", "--ep_size", "2",
                          "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    metrics = _read_metrics(out)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert summary["tokens_seen"] == 6 * 4 * 2 * 2 * 256
    # final/ holds all 8 experts although each rank trained 4, and loads (here: a process that did not train)
    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    ids = AutoTokenizer.from_pretrained(out / "final")("[count] 3 4 5", return_tensors="pt").input_ids
    assert model.config.moe_ep_size == 1
    assert len(model.model.layers[0].mlp.moe.deepspeed_moe.experts.deepspeed_experts) == 8
    assert model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    # the DeepSpeed checkpoint (one expert file per expert, from both ranks) exports to the same model
    export_main([str(out), str(tmp_path / "exported")])
    ids = torch.randint(5, 100, (1, 12))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(out / "final").eval()(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_accelerate_launch_with_the_shipped_deepspeed_plugin_config(tmp_path, run_command):
    out = tmp_path / "run"
    # --ds_config is not passed: it comes from the config file's deepspeed_config_file
    result = run_command(["accelerate", "launch", "--config_file", "launchers/accelerate_deepspeed.yaml",
                          "launchers/train.py", "--arch", "hybrid", "--max_steps", "3", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens_seen"] == 3 * 16 * 2 * 256


def test_default_config_is_the_debug_dense_run():
    """What `make train` trains, as the run's own argument parser reads its command: the debug dense model on the
    embedded corpus, 600 steps of 16 rows, fp32, on the CPU."""
    import shlex
    import subprocess

    from adaptive_ds import ds_config
    from adaptive_ds.presets import PRESETS, model_config
    from adaptive_ds.training.arguments import parse

    outer = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")  # under `make test`, a make of its own, not a sub-make
    env = {k: v for k, v in os.environ.items() if k not in outer}
    recipe = subprocess.run(["make", "-n", "train"], cwd=ROOT, capture_output=True, text=True, check=True,
                            env=env).stdout
    launcher, script, *argv = shlex.split(recipe.strip().splitlines()[-1])  # after setup's lines, if it is due
    assert launcher == ".venv/bin/deepspeed" and script == "launchers/train.py", recipe
    assert argv[0] == "--ds_config" and str(ROOT / argv[1]) == DEBUG_CPU and len(argv) == 2
    settings, config = parse(["--ds_config", DEBUG_CPU, *argv[2:]], world_size=1)
    assert (settings.preset, settings.arch, settings.data, settings.variant, settings.model) == \
        ("debug", "dense", "embedded", None, {})
    assert (settings.max_steps, settings.warmup_steps, settings.tokens, settings.micro_batch) == (600, 30, None, None)
    layout = ds_config.read(config)
    assert (layout.micro_batch, layout.accumulation, layout.precision, layout.zero_stage) == (16, 1, "fp32", 1)
    assert layout.offload_optimizer == "none" and config["optimizer"]["params"]["torch_adam"]  # nothing needs a GPU
    model = model_config(settings.preset, settings.arch, 256, **settings.model)
    preset = PRESETS["debug"]
    assert not model.uses_moe and not model.uses_mod  # every block a plain attention + SwiGLU block
    assert (model.hidden_size, model.num_hidden_layers, model.max_position_embeddings) == \
        (preset.hidden_size, preset.num_hidden_layers, preset.seq_len) == (128, 4, 256)


def test_compile_trains_the_same_model(tmp_path):
    config = _tiny_ds_config(tmp_path, micro=2, accum=1, max_steps=2, log_steps=1, eval_batches=1)
    eager = train(["--ds_config", config, "--output_dir", str(tmp_path / "eager")])
    compiled = train(["--ds_config", config, "--output_dir", str(tmp_path / "compiled"), "--compile"])
    assert compiled["compiled"] and not eager["compiled"]
    assert _read_metrics(tmp_path / "compiled")[0]["loss"] == pytest.approx(
        _read_metrics(tmp_path / "eager")[0]["loss"], rel=1e-4)
    assert compiled["validation_loss"] == pytest.approx(eager["validation_loss"], rel=1e-3)
    # the compiled module keeps its parameter names: final/ loads as usual
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "compiled" / "final")
    assert sum(p.numel() for p in model.parameters()) == compiled["total_parameters"]
