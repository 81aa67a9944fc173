"""`python -m adaptive_ds.tools.acceptance`: the verdicts on the GPU targets from made-up stage records (met, missed by
a little, a crashed stage, a missing figure, a dry run), the exit code and last lines, and where its outputs go."""

import copy
import json
import math

import pytest
from helpers.common import ROOT

from adaptive_ds.tools import acceptance, report, staleness
from adaptive_ds.tools.acceptance import STAGES, TARGETS, failures, judge, markdown, summary_lines
from adaptive_ds.tools.benchmark import RATIOS


def _passing() -> dict:
    """Stage records as the stages write them on a GPU, each figure a little on the good side of its target."""
    return {
        "gpu_tests": {"ok": True, "command": "pytest -m gpu tests/integration/test_gpu.py",
                      "summary": "6 passed in 40.1s"},
        "b1_t4": {"ok": True, "steps": 30, "peak_allocated_gib": 11.9, "peak_reserved_gib": 13.0,
                  "predicted_peak_gib": 6.8, "training_tokens_per_s": 2500.0},
        "benchmark": {"ok": True, "preset": "debug_200m", "date": "2026-12-01", "machine": "NVIDIA H200 (1 GPU)",
                      "commit": "abc1234", "command": "python -m adaptive_ds.tools.benchmark --preset debug_200m",
                      "seq_len": 2048, "micro_batch": 8, "precision": "bf16", "steps_per_round": 5, "rounds": 5,
                      "warmup_steps": 5, "device": "NVIDIA H200", "peak_tflops": 989.0, "torch": "2.13.0",
                      "deepspeed": "0.18.0",
                      "results": {"dense": {"mfu": 0.46, "tokens_per_s": 90000.0, "achieved_tflops": 455.0,
                                            "compiled": False, "rounds": [89e3, 90e3, 91e3, 88e3, 92e3]},
                                  "moe": {"mfu": 0.30, "tokens_per_s": 60000.0, "achieved_tflops": 297.0,
                                          "compiled": False, "rounds": [59e3, 60e3, 61e3, 58e3, 62e3]}},
                      "ratios": {"dense/hf_llama_compile": 1.31, "moe/moe_deepspeed": 2.51, "moe/hf_mixtral": 2.6,
                                 "mod/dense": 1.61, "hybrid/moe": 1.41, "dense/hf_llama": 1.5}},
        "b7": {"ok": True, "steps": 3, "losses": [10.9, 10.8, 10.6], "finite_loss_steps": 3,
               "peak_allocated_gib": 120.0, "peak_reserved_gib": 125.0, "step_s": [40.0, 30.0, 30.0]},
    }


# Each target missed by a little: (stage, where its figure sits in the record, the value, words of its name)
JUST_MISSED = [
    ("benchmark", ("results", "dense", "mfu"), 0.449, "45% MFU"),
    ("benchmark", ("ratios", "dense/hf_llama_compile"), 1.299, "(dense / hf_llama_compile)"),
    ("benchmark", ("ratios", "moe/moe_deepspeed"), 2.499, "(moe / moe_deepspeed)"),
    ("benchmark", ("ratios", "moe/hf_mixtral"), 2.499, "(moe / hf_mixtral)"),
    ("benchmark", ("ratios", "mod/dense"), 1.599, "(mod / dense)"),
    ("benchmark", ("ratios", "hybrid/moe"), 1.399, "(hybrid / moe)"),
    ("b1_t4", ("peak_allocated_gib",), 12.01, "peak allocated <= 12 GiB"),
    ("b7", ("finite_loss_steps",), 2, "finite losses"),
    ("b7", ("peak_allocated_gib",), 141.01, "H200's memory"),
]


def _set(record: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        record = record[key]
    record[path[-1]] = value


def _report(stages: dict, dry: bool = False) -> dict:
    return {"stages": stages, "targets": judge(stages, dry), "dry_run": dry}


def test_every_target_is_met_by_a_passing_run_and_the_figures_are_the_stages_own():
    stages = _passing()
    verdicts = judge(stages, dry=False)
    assert [v["verdict"] for v in verdicts] == ["met"] * 9 and len(TARGETS) == 9
    measured = {v["figure"]: v["measured"] for v in verdicts if v["stage"] == "benchmark"}
    assert measured == {"results.dense.mfu": 0.46, "ratios.dense/hf_llama_compile": 1.31,
                        "ratios.moe/moe_deepspeed": 2.51, "ratios.moe/hf_mixtral": 2.6, "ratios.mod/dense": 1.61,
                        "ratios.hybrid/moe": 1.41}
    # the ratios the targets read are ones the benchmark computes
    assert {f"{a}/{b}" for a, b in RATIOS} >= {name.split(".", 1)[1] for name in measured if name.startswith("ratios.")}
    assert failures(_report(stages)) == []
    assert summary_lines(_report(stages), "out.json")[-1] == ("passed: every stage completed and every target "
                                                              "measured was met")
    # a figure exactly at its threshold meets it
    _set(stages["benchmark"], ("ratios", "mod/dense"), 1.6)
    _set(stages["b1_t4"], ("peak_allocated_gib",), 12.0)
    assert all(v["verdict"] == "met" for v in judge(stages, dry=False))


@pytest.mark.parametrize("stage,path,value,words", JUST_MISSED, ids=[m[3] for m in JUST_MISSED])
def test_a_target_missed_by_a_little_fails_the_run_naming_its_stage_and_target(stage, path, value, words):
    stages = _passing()
    _set(stages[stage], path, value)
    verdicts = judge(stages, dry=False)
    missed = [v for v in verdicts if v["verdict"] != "met"]
    assert len(missed) == 1 and missed[0]["verdict"] == "missed" and words in missed[0]["target"]
    assert missed[0]["stage"] == stage and missed[0]["measured"] == value
    lines = failures(_report(stages))
    assert len(lines) == 1 and lines[0].startswith(f"stage {stage} missed target ") and words in lines[0]
    last = summary_lines(_report(stages), "out.json")[-1]
    assert last == f"FAILED: {lines[0]}"


def test_the_missed_figure_is_printed_with_its_threshold():
    stages = _passing()
    _set(stages["benchmark"], ("results", "dense", "mfu"), 0.412)
    _set(stages["b1_t4"], ("peak_allocated_gib",), 12.5)
    lines = failures(_report(stages))
    assert lines == ['stage benchmark missed target "dense debug_200m >= 45% MFU": measured 41.2%, needs >= 45.0%',
                     'stage b1_t4 missed target "`b1_t4.json` peak allocated <= 12 GiB under the 15 GiB cap, beside '
                     'the planner\'s prediction": measured 12.50 GiB, needs <= 12.00 GiB']


def test_a_crashed_stage_fails_the_run_and_leaves_its_targets_unmeasured_the_others_judged():
    stages = _passing()
    stages["b7"] = {"ok": False, "error": "Traceback (most recent call last):\n  ...\n"
                                          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                    "seconds": 12.0}
    _set(stages["benchmark"], ("ratios", "hybrid/moe"), 1.2)
    verdicts = {v["target"]: v["verdict"] for v in judge(stages, dry=False)}
    b7 = [v for name, v in verdicts.items() if name.startswith("b7")]
    assert b7 == ["not measured (stage failed)"] * 2
    assert sum(v == "met" for v in verdicts.values()) == 6
    lines = failures(_report(stages))
    assert lines[0].startswith("stage b7 failed: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                               "2.00 GiB; not measured: b7 dense trains on one H200")
    assert lines[1].startswith('stage benchmark missed target "hybrid (MoD 0.5 in every block) >= 1.4x moe')
    assert len(lines) == 2


def test_a_failed_stage_is_named_by_its_exception_not_by_what_the_process_printed_after_it():
    """Seen on an H200: a stage's stderr ended with NCCL's teardown warning, after the traceback of the error."""
    stages = _passing()
    stages["benchmark"] = {"ok": False, "seconds": 23.0, "error": (
        "[rank0]: Traceback (most recent call last):\n[rank0]:   File \"builder.py\", line 710, in <genexpr>\n"
        "[rank0]: ValueError: invalid literal for int() with base 10: '0a'\n"
        "[rank0]:[W1204 16:59:30.854396800 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() "
        "was not called before program exit, which can leak resources.")}
    report = {**_report(stages), "date": "2026-12-04", "machine": "NVIDIA H200 (1 GPU)", "torch": "2.11.0",
              "deepspeed": "0.19.8", "commit": "abc1234", "command": "python -m adaptive_ds.tools.acceptance"}
    assert failures(report)[0].startswith("stage benchmark failed: ValueError: invalid literal for int() with base "
                                          "10: '0a'; not measured: dense debug_200m >= 45% MFU")
    row = next(line for line in markdown(report).splitlines() if line.startswith("| benchmark |"))
    assert row == "| benchmark | **failed**: ValueError: invalid literal for int() with base 10: '0a' | - | 23 |"


@pytest.mark.parametrize("raised", ["Exception: boom", "subprocess.TimeoutExpired: Command '['x']' timed out after 5 "
                                    "seconds", "torch._dynamo.exc.Unsupported: a graph break", "StopIteration"])
def test_any_exception_a_traceback_ends_with_names_the_stage(raised):
    """Whatever the exception's class is called: the traceback's own last line, not what was printed after it."""
    from adaptive_ds.tools.acceptance import _last_line

    error = (f"[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in <module>\n"
             f"[rank0]:     main()\n[rank0]: {raised}\n[rank0]:[W1204 ProcessGroupNCCL.cpp:1575] Warning: teardown")
    assert _last_line(error) == raised
    assert _last_line("no traceback here\nthe last line") == "the last line" and _last_line("") == "no error message"


def test_a_stage_run_again_alone_is_rendered_with_its_command_and_why():
    stages = _passing()
    report = {**_report(stages), "date": "2026-12-04", "machine": "NVIDIA H200 (1 GPU)", "torch": "2.11.0",
              "deepspeed": "0.19.8", "commit": "abc1234", "command": "python -m adaptive_ds.tools.acceptance",
              "reruns": {"benchmark": {"command": "python -m adaptive_ds.tools.acceptance --stage benchmark",
                                       "why": "the first attempt failed"}}}
    stages["benchmark"]["seconds"] = None
    text = markdown(report)
    assert ("Stage benchmark's record comes from a second run of that stage alone, in its own process as the command "
            "runs each stage, `python -m adaptive_ds.tools.acceptance --stage benchmark`: the first attempt failed."
            ) in text
    assert "| benchmark | completed | debug_200m bf16, micro-batch 8: section `throughput:debug_200m:gpu` below | - |" \
        in text
    assert "stage benchmark: completed (0 s)" in summary_lines(report, "r.json")


@pytest.mark.parametrize("missing", ["none", "absent", "nan"])
def test_a_figure_missing_from_a_completed_stage_fails_the_run(missing):
    stages = _passing()
    if missing == "absent":
        del stages["b1_t4"]["peak_allocated_gib"]  # e.g. a stage that measured on the CPU
    else:  # an unknown GPU has no peak to give an MFU; a NaN is no figure either
        _set(stages["b1_t4"], ("peak_allocated_gib",), None if missing == "none" else math.nan)
    verdict = [v for v in judge(stages, dry=False) if v["stage"] == "b1_t4"][0]
    assert verdict["verdict"] == "not measured (figure missing)" and verdict["measured"] is None
    assert failures(_report(stages)) == [
        'stage b1_t4 did not measure target "`b1_t4.json` peak allocated <= 12 GiB under the 15 GiB cap, beside the '
        'planner\'s prediction": its record has no figure peak_allocated_gib']


def test_a_dry_run_and_a_stage_not_run_measure_nothing_and_fail_nothing():
    stages = _passing()
    _set(stages["benchmark"], ("results", "dense", "mfu"), 0.01)  # a CPU's figures are no measurement
    assert {v["verdict"] for v in judge(stages, dry=True)} == {"not measured (dry run)"}
    assert failures(_report(stages, dry=True)) == []
    only = {"b1_t4": _passing()["b1_t4"]}
    verdicts = judge(only, dry=False)
    assert [v["verdict"] for v in verdicts if v["stage"] != "b1_t4"] == ["not measured (stage not run)"] * 8
    assert failures(_report(only)) == []


def _fake_stages(monkeypatch, stages: dict) -> list:
    """The command on a CUDA machine, its stages replaced by these records and its provenance made up (no git
    process: the sections it renders are of the code as it is); returns the stages it ran."""
    ran = []
    monkeypatch.setattr(staleness, "staleness", lambda commit, paths, repo=None: staleness.Staleness(commit, paths))

    def fake_stage(name, dry, workdir, micro_batch):
        ran.append((name, dry))
        return {**copy.deepcopy(stages[name]), "seconds": 1.0}

    monkeypatch.setattr(acceptance, "_run_stage", fake_stage)
    monkeypatch.setattr(acceptance.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(report, "machine", lambda: "NVIDIA H200 (1 GPU)")
    monkeypatch.setattr(report, "commit", lambda: "abc1234")
    return ran


def test_the_command_exits_non_zero_on_a_missed_target_and_writes_only_under_the_working_directory(
        tmp_path, monkeypatch, capsys):
    stages = _passing()
    _set(stages["benchmark"], ("ratios", "moe/hf_mixtral"), 2.3)
    ran = _fake_stages(monkeypatch, stages)
    monkeypatch.chdir(tmp_path)
    committed = {path: path.read_bytes() for path in [ROOT / "BENCHMARKS.md", *(ROOT / "benchmarks").rglob("*")]
                 if path.is_file()}
    with pytest.raises(SystemExit) as exited:
        acceptance.main([])
    assert exited.value.code == 1 and ran == [(name, False) for name in STAGES]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == ('FAILED: stage benchmark missed target "moe >= 2.5x HF `MixtralForCausalLM` (moe / '
                         'hf_mixtral), same routing": measured 2.30x, needs >= 2.50x')
    assert "target moe >= 2.5x HF `MixtralForCausalLM` (moe / hf_mixtral), same routing [benchmark, needs >= 2.50x]:" \
           " MISSED: 2.30x" in lines
    # the report under runs/acceptance of the working directory; no Markdown file written, nothing committed touched
    (out,) = (tmp_path / "runs" / "acceptance").iterdir()
    assert out.name.startswith("acceptance_gpu_") and lines[-2] == f"report: {out.relative_to(tmp_path)}"
    written = json.loads(out.read_text())
    assert written["stages"]["b7"]["finite_loss_steps"] == 3 and len(written["targets"]) == 9
    assert [v["verdict"] for v in written["targets"]].count("missed") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert {path: path.read_bytes() for path in committed} == committed


def test_the_section_names_each_target_with_its_figure_and_a_passing_run_exits_zero(tmp_path, monkeypatch, capsys):
    _fake_stages(monkeypatch, _passing())
    md, out = tmp_path / "B.md", tmp_path / "a.json"
    md.write_text("# Benchmarks\n")
    acceptance.main(["--out", str(out), "--benchmarks_md", str(md)])  # no SystemExit: exit status 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("passed:")
    text = md.read_text()
    assert "<!-- acceptance:gpu -->" in text and "<!-- throughput:debug_200m:gpu -->" in text
    assert "| dense debug_200m >= 45% MFU | benchmark | >= 45.0% | 46.0% | met |" in text
    assert "| mod (capacity 0.5 in every block: the `mod` case) >= 1.6x dense (mod / dense) | benchmark | >= 1.60x | " \
           "1.61x | met |" in text
    assert "| b7 dense peak allocated within an H200's memory (<= 141 GiB) | b7 | <= 141.00 GiB | 120.00 GiB | met |" \
           in text
    assert json.loads(out.read_text())["targets"][0]["measured"] == 0.46


def test_a_dry_run_reports_its_targets_not_measured_and_exits_zero(tmp_path, monkeypatch, capsys):
    ran = _fake_stages(monkeypatch, _passing())
    acceptance.main(["--dry_run", "--out", str(tmp_path / "a.json"), "--stages", "b1_t4", "b7"])
    assert ran == [("b1_t4", True), ("b7", True)]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "dry run: every stage completed; no target measured"
    assert sum(line.endswith("not measured (dry run)") for line in lines) == 9


def test_bad_arguments_are_refused_in_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    ran = _fake_stages(monkeypatch, _passing())
    for argv, message in [(["--benchmarks_md", str(tmp_path / "nowhere" / "B.md")], "its folder does not exist"),
                          (["--out", str(tmp_path)], "is a folder; it names the JSON report's file"),
                          (["--micro_batch", "0"], "--micro_batch 0 must be at least 1"),
                          (["--stages", "b8"], "argument --stages: invalid choice: 'b8'")]:
        with pytest.raises(SystemExit) as exited:
            acceptance.main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
    assert ran == []


def test_the_targets_are_the_rows_of_the_gpu_targets_table_in_benchmarks_md():
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text.split("## GPU targets", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[0].removeprefix("| ") for line in section.splitlines() if line.startswith("| ")]
    assert rows[0] == "target" and [t.name for t in TARGETS] == [row for row in rows[1:] if "grid" not in row]


class _Accelerator:
    """DeepSpeed's accelerator as a machine without half precisions or a working compiler reports itself (this
    machine has both, so only a stand-in reaches the branch)."""

    def device_name(self):
        return "cpu"

    def is_fp16_supported(self):
        return False

    def is_bf16_supported(self):
        return False

    def create_op_builder(self, name):
        assert name == "CPUAdamBuilder"
        return self

    def load(self):
        raise RuntimeError("Error building extension 'cpu_adam'")


def test_a_dry_run_leaves_out_only_what_the_machine_cannot_run_and_says_why(monkeypatch, caplog):
    import deepspeed.accelerator

    written = json.loads((ROOT / "ds_configs" / "b1_t4.json").read_text())
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", _Accelerator)
    config = acceptance._ds_config("b1_t4.json", dry=True)
    assert "fp16" not in config and "offload_optimizer" not in config["zero_optimization"]
    assert config["optimizer"]["params"]["torch_adam"] and config["zero_optimization"]["stage"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["dry run of b1_t4.json without fp16: DeepSpeed's cpu accelerator has no fp16 here",
                        "dry run of b1_t4.json without the optimizer offload: DeepSpeed's CPU Adam does not build here "
                        "(Error building extension 'cpu_adam')"]
    # a GPU run takes the shipped file's sections as written (the dry run where the machine has them:
    # tests/integration/test_acceptance.py)
    kept = acceptance._ds_config("b1_t4.json", dry=False)
    assert kept["fp16"] == written["fp16"] and kept["zero_optimization"] == written["zero_optimization"]
