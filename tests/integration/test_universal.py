"""Resuming on another number of processes or expert-parallel size (DeepSpeed's universal checkpoint; MoE through
adaptive_ds.training.universal): the fp32 master weights, Adam moments, Adam step, learning rate and schedule
after the load equal what the saving run held (whole tensors, by parameter name, dumped by
tests/helpers/train_and_dump.py), and the losses continue the saving run's own curve."""

import json
import shutil

import pytest
import torch
from helpers.common import run_command, write_ds_config
from helpers.corpora import prepared
from helpers.train_and_dump import dumping

from adaptive_ds.training import train
from adaptive_ds.training.checkpoint import (
    CheckpointError,
    latest_tag,
    universal_tag,
)

HELPER = "tests/helpers/train_and_dump.py"
# No dropped tokens: an expert's capacity depends on the tokens per rank, and with drops the same step on one
# process and on two computes a (slightly) different loss by design, which would blur the continuation check.
MODEL = {"num_hidden_layers": 2, "moe_drop_tokens": False}
DENSE_MODEL = {"num_hidden_layers": 2}  # a MoE field is refused with dense
TENSORS = ("weight", "fp32", "exp_avg", "exp_avg_sq")


def _configs(directory, arch, data=None):
    """Two processes x micro 2 and one process x micro 2 x accumulation 2: the same global batch (a checkpoint
    resumes only with its batch layout). Checkpoints at steps 2 and 4."""
    block = dict(arch=arch, max_steps=4, warmup_steps=1, save_steps=2, log_steps=1,
                 model=MODEL if arch in ("moe", "hybrid") else DENSE_MODEL,
                 **({"data": data} if data else {}))
    return write_ds_config(directory, 2, 1, **block), write_ds_config(directory, 2, 2, **block)


def _run(dump, config, out, processes, *args) -> None:
    """Two processes: torchrun in a subprocess. One: in this process, which needs no launcher."""
    argv = ["--ds_config", config, "--output_dir", str(out), *args]
    if processes == 1:
        with dumping(str(dump)):
            train(argv)
        return
    result = run_command(["torchrun", "--nproc_per_node", "2", HELPER, str(dump), *argv])
    assert result.returncode == 0, result.stderr[-3000:]


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _train(directory, arch, *args, data=None):
    """A 2-process run to step 4, then put back to its step-2 checkpoint (as if killed after it)."""
    two, one = _configs(directory, arch, data)
    out = directory / "run"
    _run(directory / "saved", two, out, 2, *args)
    reference = _losses(out)
    (out / "checkpoints" / "latest").write_text("step00000002")
    shutil.rmtree(out / "checkpoints" / "step00000004")
    return out, reference, two, one


def _dumped(directory, event):
    """The ranks' dumps of `event` as one dict; a parameter dumped by several ranks must agree."""
    params, engine = {}, None
    for path in sorted(directory.glob(f"{event}_rank*.pt")):
        state = torch.load(path, weights_only=False)
        engine = engine or state["engine"]
        assert state["engine"] == engine
        for name, value in state["params"].items():
            if name in params:
                for key in TENSORS:
                    assert torch.equal(params[name][key], value[key]), (name, key)
            params[name] = value
    assert params, f"no {event} dump in {directory}"
    return params, engine


def _assert_restored(saved_dir, loaded_dir, step, num_experts=None):
    saved, saved_engine = _dumped(saved_dir, f"saved_step{step}")
    loaded, loaded_engine = _dumped(loaded_dir, f"loaded_step{step}")
    assert sorted(loaded) == sorted(saved)
    if num_experts:  # every expert of every layer, by its global number
        assert sum(".deepspeed_experts." in name for name in saved) == num_experts * 3 * MODEL["num_hidden_layers"]
    for name, want in saved.items():
        got = loaded[name]
        for key in TENSORS:
            assert torch.equal(got[key], want[key]), f"{name} {key} differs after the load"
        assert torch.equal(got["weight"], got["fp32"]), name  # the module computes with the master weights
        assert got["step"] == want["step"] == step and got["group"] == want["group"], name
        assert got["group"]["lr"] > 0
    assert any(want["exp_avg_sq"].abs().sum() > 0 for want in saved.values())  # trained moments, not zeros
    assert loaded_engine == saved_engine and saved_engine["global_steps"] == step


def _assert_continues(resumed, reference, rel):
    assert sorted(resumed) == [1, 2, 3, 4] and [resumed[1], resumed[2]] == [reference[1], reference[2]]
    assert [resumed[3], resumed[4]] == pytest.approx([reference[3], reference[4]], rel=rel)


def _assert_resumed_on_one_process(tmp_path, out, reference, config, capfd, num_experts=None):
    capfd.readouterr()
    _run(tmp_path / "resumed", config, out, 1)  # the same ds_config; ep_size 1: the default
    logged = capfd.readouterr().err
    assert "through DeepSpeed's universal format" in logged
    assert "gradient accumulation 2 keeps its global batch of 4 rows" in logged  # re-derived
    _assert_restored(tmp_path / "saved", tmp_path / "resumed", 2, num_experts=num_experts)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["world_size"] == 1
    # the same rows per step, in one process: equal to float32 summation order
    _assert_continues(_losses(out), reference, rel=1e-4)


@pytest.mark.slow
def test_a_two_process_dense_checkpoint_resumes_on_one_process_with_what_it_saved(tmp_path, capfd):
    """Dense stands for mod too, whose parameters convert as dense's do (no expert layout); the expert layouts are the
    test below. On prepared data: its global sample index also makes 2 processes x 2 rows and 1 process x 2 x 2 rows
    train on the same rows (the resume below continues the 2-process curve on one process)."""
    data = prepared(tmp_path, seq_len=256)
    out, reference, two, one = _train(tmp_path, "dense", data=data)
    train(["--ds_config", one, "--output_dir", str(tmp_path / "one")])
    assert list(_losses(tmp_path / "one").values()) == pytest.approx(list(reference.values()), rel=2e-5)
    _assert_resumed_on_one_process(tmp_path, out, reference, two, capfd)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_on_one_process_and_with_another_ep_size_on_the_same_processes(
        tmp_path, capfd):
    """The hybrid: every parameter kind moe has (experts split over ep_size 2, their gates) and mod's routers and
    predictors beside them, so one 2-process run covers moe's expert layout and the hybrid's (moe alone: the layout
    matrix, tests/integration/test_layout_matrix.py, resumes its checkpoints across ep_size)."""
    out, reference, two, _ = _train(tmp_path, "hybrid", "--ep_size", "2")  # one 2-process run for both
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine)
    _assert_resumed_on_one_process(tmp_path, out, reference, two, capfd, num_experts=8)

    shutil.rmtree(out)
    shutil.copytree(pristine, out)
    _run(tmp_path / "ep1", two, out, 2, "--ep_size", "1")
    _assert_restored(tmp_path / "saved", tmp_path / "ep1", 2, num_experts=8)
    _assert_continues(_losses(out), reference, rel=1e-5)
    # the other way, ep_size 1 to 2 (each rank taking its half of the experts), is
    # tests/integration/test_layout_matrix.py's "moe ep_size 1->2" layout, which resumes a killed run of it


def test_an_moe_checkpoint_without_zero_partitions_is_refused_and_left_alone(tmp_path, tiny_ds_config):
    out = tmp_path / "run"
    config = tiny_ds_config(2, 1, zero_stage=0, arch="moe", max_steps=1, model=MODEL)
    train(["--ds_config", config, "--output_dir", str(out)])
    tag = latest_tag(str(out))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="only from ZeRO stage 1 or 2"):
        universal_tag(str(out), tag, 1)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before


def test_a_universal_checkpoint_whose_param_groups_do_not_pair_with_the_run_is_refused(tmp_path, tiny_config,
                                                                                       tiny_ds_config):
    """DeepSpeed's universal loader pairs param groups by position: a run with more groups than the checkpoint
    would keep fresh weights in the extra ones. Here the saved state has one group fewer than the engine."""
    import deepspeed

    from adaptive_ds import distributed
    from adaptive_ds.models import AdaptiveDSForCausalLM
    from adaptive_ds.training import moe_adapter
    from adaptive_ds.training.checkpoint import check_param_groups
    from adaptive_ds.training.optim import parameter_groups

    distributed.init_distributed()
    config = json.loads(open(tiny_ds_config()).read())
    del config["adaptive_ds"]
    model = AdaptiveDSForCausalLM(tiny_config("moe"))
    moe_adapter.prepare(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1), config=config)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups]
    (tmp_path / "u" / "zero").mkdir(parents=True)
    torch.save({"param_groups": groups}, tmp_path / "u" / "zero" / "optimizer_state.pt")
    check_param_groups(engine, str(tmp_path / "u"), "step00000002")  # as many: accepted
    torch.save({"param_groups": groups[:-1]}, tmp_path / "u" / "zero" / "optimizer_state.pt")
    with pytest.raises(CheckpointError, match=rf"holds {len(groups) - 1} optimizer param groups and this run's "
                                              rf"layout {len(groups)}"):
        check_param_groups(engine, str(tmp_path / "u"), "step00000002")
