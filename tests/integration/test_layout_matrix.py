"""A run killed and resumed on another layout, on the real DeepSpeed engine: one process to two, two to one, and
moe from ep_size 1 to 2; with a token budget and with max_steps; resumed plainly, or resumed and then rolled back
past a real loss spike before the new layout's first save (to the checkpoint of the old layout, through the
universal format). The six cells cover every pair of (layout change, budget kind, recovery).

In every cell the run trains exactly its budget (the global batch stays the first layout's), and its losses equal
an uninterrupted run's that meets the same faults: bit-equal on the first layout's steps where the reference ran
on that layout too, within 1e-5 after the change. The references run in this process, on one process with the
same global batch (the embedded corpus serves global samples by index, so every layout trains the same tokens)."""

import json
import shutil
import sys

import pytest
from helpers.common import ROOT, run_command, write_ds_config
from helpers.faults import Faults

from adaptive_ds.training import train

FAULTS_SCRIPT = str(ROOT / "tests" / "helpers" / "train_with_faults.py")
STEPS, SAVE_STEPS, KILL_BEFORE, SPIKE_AT = 8, 4, 6, 6  # the kill leaves step 4's checkpoint; the spike precedes 8's
SEQ_LEN = 256
# moe without dropped tokens: an expert's capacity depends on the tokens per rank, so with drops one process and
# two compute the same step differently by design
MODELS = {"dense": {"num_hidden_layers": 2}, "moe": {"num_hidden_layers": 2, "moe_drop_tokens": False}}
CONTROLLER = {"spike_window": 3, "spike_sigma": 3.0}


class _StopBefore(Faults):
    """Stops an in-process run before a step, as a kill would: nothing after it runs."""

    def __init__(self, step: int, **faults):
        super().__init__(**faults)
        self.stop_before = step

    def before_step(self, trainer, step):
        if step == self.stop_before:
            raise KeyboardInterrupt(f"stopped before step {step}")
        super().before_step(trainer, step)


def _config(directory, arch, accumulation):
    return write_ds_config(directory, 2, accumulation, arch=arch, max_steps=STEPS, save_steps=SAVE_STEPS,
                           log_steps=1, warmup_steps=2, model=MODELS[arch], controller=CONTROLLER)


def _budget(kind: str, rows: int) -> list[str]:
    """8 steps of `rows` rows: as max_steps, or as a token budget a little short of 8 whole steps."""
    return ["--max_steps", str(STEPS)] if kind == "max_steps" else ["--tokens", str(STEPS * rows * SEQ_LEN - 100)]


def _launch(processes: int, faults: dict, config: str, out, *args) -> None:
    """The training command in a subprocess, on `processes` processes, with `faults` installed."""
    launcher = ["torchrun", "--nproc_per_node", str(processes)] if processes > 1 else [sys.executable]
    command = [*launcher, FAULTS_SCRIPT, json.dumps(faults), "--ds_config", config, "--output_dir", str(out), *args]
    done = run_command(command)
    if faults.get("kill_before_step"):
        assert done.returncode != 0 and not (out / "summary.json").exists(), done.stderr[-2000:]
    else:
        assert done.returncode == 0, done.stderr[-3000:]


def _run_here(config: str, out, *args, hooks=None) -> None:
    train(["--ds_config", config, "--output_dir", str(out), *args], hooks=hooks)


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# Each layout: the architecture, the first layout (processes, ep_size, accumulation of the one ds_config: micro-batch
# 2), the second, whether the first runs here, and its two cells (budget kind, recovery).
LAYOUTS = {
    "1->2 processes": ("dense", (1, 1, 2), (2, 1), [("tokens", "resume"), ("max_steps", "rollback")]),
    "2->1 processes": ("dense", (2, 1, 2), (1, 1), [("tokens", "rollback"), ("max_steps", "resume")]),
    "moe ep_size 1->2": ("moe", (2, 1, 2), (2, 2), [("tokens", "resume"), ("max_steps", "rollback")]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_resume_on_another_layout_keeps_the_budget_and_the_losses(tmp_path, layout):
    arch, (first_processes, first_ep, accumulation), (second_processes, second_ep), cells = LAYOUTS[layout]
    config = _config(tmp_path, arch, accumulation)
    rows = 2 * accumulation * first_processes  # the first layout's global batch, which the run keeps

    # references: uninterrupted, one process, the same global batch; plain and meeting the same spike
    reference_config = _config(tmp_path, arch, rows // 2)
    references = {}
    for recovery, faults in (("resume", {}), ("rollback", {"spike_at_step": SPIKE_AT})):
        out = tmp_path / f"reference-{recovery}"
        _run_here(reference_config, out, hooks=Faults(**faults))
        references[recovery] = _losses(out)
    # the first layout, killed before step 6 (its latest checkpoint: step 4), once for both cells
    killed = tmp_path / "killed"
    ep = ["--ep_size", str(first_ep)] if arch == "moe" else []
    if first_processes == 1:
        with pytest.raises(KeyboardInterrupt):
            _run_here(config, killed, *ep, hooks=_StopBefore(KILL_BEFORE))
    else:
        _launch(first_processes, {"kill_before_step": KILL_BEFORE}, config, killed, *ep)
    assert (killed / "checkpoints" / "latest").read_text() == f"step{SAVE_STEPS:08d}"

    for budget, recovery in cells:
        out = tmp_path / f"{budget}-{recovery}"
        shutil.copytree(killed, out)
        args = [*_budget(budget, rows), *(["--ep_size", str(second_ep)] if arch == "moe" else [])]
        faults = {"spike_at_step": SPIKE_AT} if recovery == "rollback" else {}
        if second_processes == 1:
            _run_here(config, out, *args, hooks=Faults(**faults))
        else:
            _launch(second_processes, faults, config, out, *args)

        summary = json.loads((out / "summary.json").read_text())
        assert summary["resumed_from_step"] == SAVE_STEPS and summary["world_size"] == second_processes
        assert summary["steps"] == STEPS and summary["tokens_seen"] == STEPS * rows * SEQ_LEN, (budget, recovery)
        losses, reference = _losses(out), references[recovery]
        assert sorted(losses) == list(range(1, STEPS + 1))
        first = range(1, SAVE_STEPS + 1)  # trained on the first layout, before the kill
        if first_processes == 1:
            assert [losses[s] for s in first] == [reference[s] for s in first]
        else:
            assert [losses[s] for s in first] == pytest.approx([reference[s] for s in first], rel=1e-5)
        after = range(SAVE_STEPS + 1, STEPS + 1)
        assert [losses[s] for s in after] == pytest.approx([reference[s] for s in after], rel=1e-5), (budget,
                                                                                                      recovery)
        rollbacks = [d for d in _jsonl(out / "decisions.jsonl") if d["action"].startswith("roll back")]
        if recovery == "rollback":
            # the spike on the new layout went back to the old layout's step-4 checkpoint, and the run recovered
            assert [d["step"] for d in rollbacks] == [SPIKE_AT]
            assert [m["step"] for m in _jsonl(out / "abandoned_metrics.jsonl")][-1:] == [SPIKE_AT - 1]
        else:
            assert rollbacks == []


@pytest.mark.slow
def test_a_second_resume_on_the_new_layout_keeps_the_first_layouts_batch(tmp_path):
    """2 processes -> 1 -> 1 again: the checkpoint saved on one process holds the global batch it kept (8 rows, where
    the ds_config gives 4 on one process), and the same command resumes it again instead of refusing a changed
    batch; the run ends as an uninterrupted one-process run of 8-row steps does. A ds_config of another batch on the
    same layout is still refused."""
    config = write_ds_config(tmp_path, 2, 2, max_steps=12, save_steps=4, log_steps=1, warmup_steps=2,
                             model=MODELS["dense"])
    reference = tmp_path / "reference"
    _run_here(write_ds_config(tmp_path, 2, 4, max_steps=12, save_steps=4, log_steps=1, warmup_steps=2,
                              model=MODELS["dense"]), reference)
    out = tmp_path / "run"
    _launch(2, {"kill_before_step": 6}, config, out)  # leaves step 4's checkpoint, 8 rows a step
    with pytest.raises(KeyboardInterrupt):
        _run_here(config, out, hooks=_StopBefore(10))  # one process: saves step 8 there
    other_batch = write_ds_config(tmp_path, 2, 1, max_steps=12, save_steps=4, log_steps=1, warmup_steps=2,
                                  model=MODELS["dense"])
    with pytest.raises(Exception, match="rows_per_step"):
        _run_here(other_batch, out)
    _run_here(config, out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == 8 and summary["steps"] == 12
    expected, got = _losses(reference), _losses(out)
    assert sorted(got) == list(range(1, 13))
    assert all(abs(got[step] - expected[step]) < 1e-5 for step in range(9, 13)), (got, expected)
