"""The width mode of the real-size benchmark (`python -m adaptive_ds.tools.realsize --layers ...`): the line fitted
through the measured peaks, the section its report renders (each figure labelled measured, fitted or projected, the
preset's own depth stated as not measured, the host question answered from both), and its flags refused in one line
before anything is measured. The measurement itself: tests/integration/test_realsize.py."""

import json

import pytest
from helpers.common import ROOT

from adaptive_ds.tools import realsize
from adaptive_ds.tools.realsize_width import fit_line


def test_points_on_a_line_are_fitted_exactly():
    fit = fit_line([2, 4, 8], [1.0 + 0.5 * 2, 1.0 + 0.5 * 4, 1.0 + 0.5 * 8])
    assert fit["intercept_gib"] == pytest.approx(1.0) and fit["slope_gib_per_layer"] == pytest.approx(0.5)
    assert fit["residuals_gib"] == pytest.approx({"2": 0.0, "4": 0.0, "8": 0.0}, abs=1e-12)


def test_the_fit_is_the_least_squares_line():
    """Worked by hand for x = 2, 4, 8 and y = 4.5, 6.6, 9.5: mean x 14/3, mean y 20.6/3; Sxx = 56/3, Sxy = 15.2667;
    slope Sxy / Sxx = 0.817857, intercept 20.6/3 - 0.817857 x 14/3 = 3.05; residuals -0.185714, +0.278571,
    -0.092857 (they sum to zero)."""
    fit = fit_line([2, 4, 8], [4.5, 6.6, 9.5])
    assert fit["slope_gib_per_layer"] == pytest.approx(0.817857, abs=1e-6)
    assert fit["intercept_gib"] == pytest.approx(3.05, abs=1e-6)
    assert fit["residuals_gib"] == pytest.approx({"2": -0.185714, "4": 0.278571, "8": -0.092857}, abs=1e-6)


def _model(layers: int, measured: float, projected: float, host: float, phase: str = "step") -> dict:
    return {"layers": layers, "parameters": 1000 * layers, "planned_parameters": 1000 * layers, "vocab_size": 32000,
            "optimizer_step": True, "loss": 10.5, "why_no_step": None, "rss_before_model_gib": 0.5,
            "peak_rss_gib": 0.5 + measured, "measured_gib": measured,
            "phases_gib": {"load": 0.25, "engine": 1.5, "forward_backward": 2.0, "step": measured},
            "projected_gib": projected, "projected_host_gib": host, "projected_device_gib": projected - host,
            "projected_phase": phase}


REPORT = {
    "date": "2026-12-02", "machine": "x86_64 CPU, 2 cores, no GPU", "commit": "abc1234",
    "command": "python -m adaptive_ds.tools.realsize --preset b1 --layers 2 4 --ds_config ds_configs/b1_t4.json "
               "--seq_len 256", "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.24.0",
    "machine_memory_gib": 23.5, "ds_config": "ds_configs/b1_t4.json", "preset": "b1", "vocab_size": 32000,
    "arch": "dense", "tokenizer": "bpe:32000", "precision": "fp16", "loss_scale": "dynamic", "zero_stage": 2,
    "offload_optimizer": "cpu", "activation_checkpointing": True, "micro_batch": 1, "seq_len": 256,
    "preset_layers": 22, "models": {"2": _model(2, 4.5, 4.25, 3.5), "4": _model(4, 6.25, 6.0, 5.0, "forward_backward")},
    "fit": {"intercept_gib": 2.75, "slope_gib_per_layer": 0.875, "residuals_gib": {"2": 0.0, "4": 0.0},
            "layers": [2, 4], "fitted_gib_at_preset": 22.0, "measured_at_preset": False,
            "projected_gib_at_preset": 20.5, "projected_host_gib_at_preset": 17.0,
            "projected_device_gib_at_preset": 3.5, "planned_parameters_at_preset": 22000,
            "projected_phase_at_preset": "step"},
    "host": {"gpu": "t4", "gpus": 1, "accumulation": 64, "pin_memory": True, "projected_host_gib": 18.5,
             "projected_accumulation_gib": 2.0, "projected_pinned_rounding_gib": 0.5, "projected_gpu_peak_gib": 6.75,
             "gpu_memory_gib": 15.0, "fitted_one_ram_gib": 22.0,
             "hosts_gib": {"the usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB)": 16.0, "Colab (T4)": 12.7,
                           "Kaggle (T4)": 29.0, "a host between": 20.0}},
}


def test_the_section_labels_each_figure_and_states_the_depth_was_not_measured():
    text = realsize.markdown(REPORT)  # the command's renderer takes both kinds of report
    assert text.startswith("Measured 2026-12-02 on x86_64 CPU") and f"`{REPORT['command']}`" in text
    assert "fp16 with dynamic loss scaling, ZeRO-2, the optimizer offloaded to CPU: DeepSpeed's CPU Adam" in text
    assert "the vocabulary of 32,000 its training tokenizer has (`bpe:32000`; the embedded tokenizer" in text
    assert "| 2 | 2,000 / 2,000 | 4.50 GiB | 0.75 GiB + 3.50 GiB = 4.25 GiB | step / step | -5.6% |" in text
    assert "| 4 | 4,000 / 4,000 | 6.25 GiB | 1.00 GiB + 5.00 GiB = 6.00 GiB | step / backward | -4.0% |" in text
    assert "| 4 | 0.25 GiB | 1.50 GiB | 2.00 GiB | 6.25 GiB |" in text
    assert "2.75 GiB + 0.88 GiB per layer (residuals: 2 layers +0.000 GiB, 4 layers +0.000 GiB)" in text
    assert "At the preset's 22 layers, which were **not measured**:" in text
    assert "| fitted (extrapolated from 2, 4 layers) | 22.00 GiB |" in text
    assert "| projected (device + host, the step's) | 3.50 GiB + 17.00 GiB = 20.50 GiB |" in text
    assert "in host RAM, 18.50 GiB per GPU projected at 32,000 vocabulary entries; of it, 2.00 GiB are DeepSpeed's " \
           "gradient accumulation buffers at the config's accumulation 64" in text
    assert "0.50 GiB torch's CUDA pinned allocator rounding each buffer the offload pins" in text
    assert "DeepSpeed's CPU accelerator pins nothing, so this measurement cannot show it" in text


def _rows(report: dict) -> dict[str, str]:
    return {line.split(" | ")[0].removeprefix("| "): line for line in realsize.markdown(report).splitlines()
            if line.startswith("| ")}


def test_the_host_question_is_answered_from_the_fit_and_the_projection():
    """A host fits only when it holds both the projected host part (18.5) and the fitted one-RAM peak (22.0); one
    below the projected host part does not; one between the two is not settled, and says so. The prose states the
    order the figures are in."""
    rows = _rows(REPORT)
    assert "**does not fit**: the projected host part alone is more" in rows["Colab (T4)"]
    assert "| 12.7 GiB |" in rows["Colab (T4)"]
    assert "fits: at least the projected host part and the fitted one-RAM peak" in rows["Kaggle (T4)"]
    assert "**does not fit**" in rows["the usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB)"]
    assert "not settled: it holds the projected host part, not the fitted one-RAM peak" in rows["a host between"]
    text = realsize.markdown(REPORT)
    assert "It is above the projected host part, 3.50 GiB more" in text and "bounds" not in text


def test_a_fitted_peak_below_the_projected_host_part_is_said_to_be_below_it_and_bounds_nothing():
    """The projection counts what the measurement had not (accumulation, pinning), so the fitted one-RAM peak can be
    the smaller: then a host between the two does not fit, and the prose says the fitted peak is below."""
    report = {**REPORT, "host": {**REPORT["host"], "projected_host_gib": 31.0, "fitted_one_ram_gib": 21.25}}
    rows, text = _rows(report), realsize.markdown(report)
    assert "It is below the projected host part, 9.75 GiB less: it bounds nothing here" in text
    assert "**does not fit**: the projected host part alone is more" in rows["Kaggle (T4)"]
    assert "**does not fit**" in rows["a host between"] and "more than the host needs" not in text


@pytest.mark.parametrize("gib, verdict", [(12.0, "**does not fit**"), (15.0, "not settled"), (20.0, "fits:"),
                                          (10.0, "fits:")])
def test_a_host_fits_only_when_it_holds_the_larger_of_the_two(gib, verdict):
    """Worked by hand: projected host part 14.0 and fitted peak 16.0 (12: below both; 15: between; 20: above both);
    projected 9.0 and fitted 8.0 (10: above both)."""
    from adaptive_ds.tools.realsize_width import host_verdict

    host = ({"projected_host_gib": 9.0, "fitted_one_ram_gib": 8.0} if gib == 10.0 else
            {"projected_host_gib": 14.0, "fitted_one_ram_gib": 16.0})
    assert host_verdict(host, gib).startswith(verdict)


def test_the_reviewers_debug_case_asks_the_host_question_at_the_measured_vocabulary():
    """`--preset debug --layers 1 2 --ds_config b1_t4.json --seq_len 32 --vocab_size 100`, its measurements as
    recorded (a fitted one-RAM peak of 0.10 GiB at its 4 layers), restated: the host question is planned at the
    100-entry vocabulary measured, not the presets' 32,000; its projected host part is then below the fitted peak, and
    the section says so."""
    from adaptive_ds.ds_config import load
    from adaptive_ds.tools.planner import plan_ds_config
    from adaptive_ds.tools.realsize_width import restate

    report = {**REPORT, "command": "python -m adaptive_ds.tools.realsize --preset debug --layers 1 2 --ds_config "
                                   "ds_configs/b1_t4.json --seq_len 32 --vocab_size 100",
              "preset": "debug", "vocab_size": 100, "tokenizer": None, "seq_len": 32, "preset_layers": 4,
              "models": {"1": _model(1, 0.04, 0, 0), "2": _model(2, 0.06, 0, 0)},
              "fit": {"intercept_gib": 0.02, "slope_gib_per_layer": 0.02, "residuals_gib": {"1": 0.0, "2": 0.0},
                      "layers": [1, 2], "fitted_gib_at_preset": 0.10, "measured_at_preset": False},
              "host": {"gpu": "t4"}}
    restated = restate(report)
    at_100 = plan_ds_config("debug", "dense", "t4", load("b1_t4.json"), vocab_size=100)
    at_32000 = plan_ds_config("debug", "dense", "t4", load("b1_t4.json"))
    assert restated["host"]["projected_host_gib"] == at_100.cpu_states_gib < at_32000.cpu_states_gib
    assert restated["host"]["projected_host_gib"] < restated["host"]["fitted_one_ram_gib"] == 0.10
    assert restated["models"]["2"]["measured_gib"] == 0.06  # the measurements stay as recorded
    text = realsize.markdown(restated)
    assert "projected at 100 vocabulary entries" in text and "It is above the projected host part" in text
    rows = _rows(restated)
    assert all("fits: at least" in rows[name] for name in restated["host"]["hosts_gib"])


@pytest.mark.parametrize("flags, message", [
    (["--layers", "4"], "--layers 4: two or more distinct positive layer counts"),
    (["--layers", "2", "2"], "--layers 2 2: two or more distinct positive layer counts"),
    (["--layers", "0", "2", "--ds_config", "b1_t4.json"], "--layers 0 2: two or more distinct positive"),
    (["--layers", "2", "4"], "--layers needs --ds_config: the engine to measure"),
    (["--layers", "2", "4", "--models", "SmolLM2-360M", "--ds_config", "b1_t4.json"], "--models and --layers are two "
                                                                                       "modes: pass one"),
    (["--preset", "b1"], "--preset belong to the width mode: pass --layers too"),
    (["--ds_config", "b1_t4.json", "--gpu", "a100"], "--ds_config, --gpu belong to the width mode"),
    (["--layers", "2", "4", "--ds_config", "no_such.json"], "ds_config 'no_such.json' does not exist"),
    (["--layers", "2", "4", "--ds_config", "b1_t4.json", "--vocab_size", "0"], "--vocab_size and --seq_len must be"),
    (["--layers", "2", "4", "--ds_config", "b1_t4.json", "--seq_len", "4096"], "--seq_len 4096: at most 2048, preset "
                                                                                "b1's context"),
    (["--layers", "1", "2", "--ds_config", "b1_t4.json", "--preset", "debug", "--seq_len", "512"], "--seq_len 512: at "
                                                                                                   "most 256, preset "
                                                                                                   "debug's"),
    (["--seq_len", "4096"], "--seq_len 4096: at most 2048, the longest a run of a folder trains at"),
    (["--restate", "benchmarks/realsize_cpu.json"], "--restate benchmarks/realsize_cpu.json: not a width report"),
    (["--restate", "benchmarks/nowhere.json"], "--restate benchmarks/nowhere.json: no such file"),
    (["--restate", "benchmarks/realsize_b1_cpu.json", "--layers", "2", "4"], "--restate rewrites a report without "
                                                                             "measuring: drop --layers"),
])
def test_bad_flags_are_refused_in_one_line_before_anything_is_measured(flags, message, monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(realsize.realsize_width, "run_width_benchmark", measured)
    monkeypatch.setattr(realsize, "run_benchmark", measured)
    monkeypatch.setattr(realsize, "_restate", measured)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as raised:
        realsize.main(flags)
    assert str(raised.value).startswith(f"error: {message}") and "\n" not in str(raised.value)


def test_a_ds_config_that_names_no_preset_needs_one(tmp_path, monkeypatch):
    (tmp_path / "engine.json").write_text('{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true}}')
    monkeypatch.setattr(realsize.realsize_width, "run_width_benchmark", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit, match=r"^error: .*engine\.json names no preset: pass --preset \(debug, "):
        realsize.main(["--layers", "1", "2", "--ds_config", str(tmp_path / "engine.json")])


@pytest.mark.parametrize("total, available, message", [
    (0.5, 0.5, r"^error: --layers 12 needs about .* GiB \(the planner's peak and a margin\), more than this machine's "
               r"0\.5 GiB: pass fewer layers$"),
    (64.0, 1.0, r"^error: the measurement needs about 13\.\d GiB of memory and 1\.0 GiB are available: run it alone"),
])
def test_the_width_mode_checks_its_largest_depth_against_the_memory_before_measuring_any(total, available, message,
                                                                                           monkeypatch):
    """b1 at 2 and 12 layers on b1_t4.json: the 12 layers' projected peak (12.5 GiB and a margin) is checked before the
    2 layers are measured, against the machine (never there) and, without --wait, against what is available now."""
    import psutil

    from adaptive_ds.tools import realsize_width

    machine = psutil.virtual_memory()._replace(total=total * 2**30, available=available * 2**30)
    monkeypatch.setattr(realsize_width.psutil, "virtual_memory", lambda: machine)
    monkeypatch.setattr(realsize_width, "measure", lambda *a: pytest.fail("measured"))
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match=message):
        realsize_width.run_width_benchmark("b1", "ds_configs/b1_t4.json", [2, 12], seq_len=256)


def _width_reports() -> list:
    return [path for path in sorted((ROOT / "benchmarks").glob("realsize_*_cpu.json"))
            if "preset_layers" in json.loads(path.read_text())]


@pytest.mark.parametrize("path", _width_reports(), ids=lambda path: path.name)
def test_a_published_width_reports_projections_are_this_versions(path, monkeypatch):
    """A change of the planner reaches every published width report: its projections and host question are what
    this version works out from its recorded measurements (`python -m adaptive_ds.tools.realsize --restate REPORT
    --benchmarks_md BENCHMARKS.md`)."""
    from adaptive_ds.tools.realsize_width import restate

    monkeypatch.chdir(ROOT)  # the report names its ds_config from the repository's root
    report = json.loads(path.read_text())
    assert restate(report) == report, f"restate {path.name}: the planner changed"


def test_the_recorded_engine_phases_show_when_the_flatten_originals_stay_in_the_process():
    """The premise of the two CPU-process rules of `planner._cpu_process_parts`, from the committed measurements.
    DeepSpeed flattens each param group into one buffer and frees the originals, with or without offload. Without
    offload (fp32, realsize_cpu.json) the engine phase holds the weights, the fp32 master copy and a third copy: the
    originals' memory stays (12 bytes per parameter, where 8 would be the states alone). With offload (fp16,
    realsize_b1_cpu.json) it holds the fp16 weights, the host's 10 bytes and the two fp16 gradient buffers of the
    largest tensor (12P + 4L), and not the originals (the fp32 weights and their fp16 cast, 6 more bytes)."""
    fp32 = json.loads((ROOT / "benchmarks" / "realsize_cpu.json").read_text())
    for name, m in fp32["models"].items():
        engine, params = m["phases_gib"]["engine"] * 2**30, m["parameters"]
        assert 12 * params * 0.98 <= engine and engine > 1.3 * 8 * params, name
    offload = json.loads((ROOT / "benchmarks" / "realsize_b1_cpu.json").read_text())
    largest = 32000 * 2048  # b1's embedding
    for n, m in offload["models"].items():
        engine, params = m["phases_gib"]["engine"] * 2**30, m["parameters"]
        states = 12 * params + 4 * largest
        assert states * 0.95 <= engine < states + 0.5 * 6 * params, n


def test_restate_rewrites_a_stale_width_report_and_its_section_without_measuring(tmp_path, monkeypatch, capsys):
    """A copy of the published b1 report with its host question as an older planner left it (no accumulation, no
    pinning: 18.56 GiB): --restate brings back this version's projections, keeps every measured figure, and writes
    the section the report renders."""
    monkeypatch.chdir(ROOT)
    published = json.loads((ROOT / "benchmarks" / "realsize_b1_cpu.json").read_text())
    stale = {**published, "host": {key: published["host"][key] for key in ("gpu", "gpus", "gpu_memory_gib",
                                                                           "fitted_one_ram_gib", "hosts_gib")}}
    stale["host"]["projected_host_gib"] = 18.563068389892578
    path, md = tmp_path / "realsize_b1_cpu.json", tmp_path / "BENCHMARKS.md"
    path.write_text(json.dumps(stale))
    monkeypatch.setattr(realsize.realsize_width, "measure", lambda *a: pytest.fail("measured"))
    realsize.main(["--restate", str(path), "--benchmarks_md", str(md)])
    restated = json.loads(path.read_text())
    assert restated == published and "restated" in capsys.readouterr().out
    assert f"<!-- realsize:b1:cpu -->\n{realsize.markdown(published)}\n<!-- /realsize:b1:cpu -->" in md.read_text()
