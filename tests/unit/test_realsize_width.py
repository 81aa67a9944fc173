"""The width mode of the real-size benchmark (`python -m adaptive_ds.tools.realsize --layers ...`): the line fitted
through the measured peaks, the section its report renders (each figure labelled measured, fitted or projected, the
preset's own depth stated as not measured, the host question answered from both), and its flags refused in one line
before anything is measured. The measurement itself: tests/integration/test_realsize.py."""

import pytest

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


def _model(layers: int, measured: float, projected: float, host: float) -> dict:
    return {"layers": layers, "parameters": 1000 * layers, "planned_parameters": 1000 * layers, "vocab_size": 32000,
            "optimizer_step": True, "loss": 10.5, "why_no_step": None, "rss_before_model_gib": 0.5,
            "peak_rss_gib": 0.5 + measured, "measured_gib": measured,
            "phases_gib": {"load": 0.25, "engine": 1.5, "forward_backward": 2.0, "step": measured},
            "projected_gib": projected, "projected_host_gib": host, "projected_device_gib": projected - host}


REPORT = {
    "date": "2026-12-02", "machine": "x86_64 CPU, 2 cores, no GPU", "commit": "abc1234",
    "command": "python -m adaptive_ds.tools.realsize --preset b1 --layers 2 4 --ds_config ds_configs/b1_t4.json "
               "--seq_len 256", "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "transformers": "5.24.0",
    "machine_memory_gib": 23.5, "ds_config": "ds_configs/b1_t4.json", "preset": "b1", "vocab_size": 32000,
    "arch": "dense", "tokenizer": "bpe:32000", "precision": "fp16", "loss_scale": "dynamic", "zero_stage": 2,
    "offload_optimizer": "cpu", "activation_checkpointing": True, "micro_batch": 1, "seq_len": 256,
    "preset_layers": 22, "models": {"2": _model(2, 4.5, 4.25, 3.5), "4": _model(4, 6.25, 6.0, 5.0)},
    "fit": {"intercept_gib": 2.75, "slope_gib_per_layer": 0.875, "residuals_gib": {"2": 0.0, "4": 0.0},
            "layers": [2, 4], "fitted_gib_at_preset": 22.0, "measured_at_preset": False,
            "projected_gib_at_preset": 20.5, "projected_host_gib_at_preset": 17.0,
            "projected_device_gib_at_preset": 3.5, "planned_parameters_at_preset": 22000},
    "host": {"gpu": "t4", "gpus": 1, "projected_host_gib": 18.5, "projected_gpu_peak_gib": 6.75,
             "gpu_memory_gib": 15.0, "fitted_one_ram_gib": 22.0,
             "hosts_gib": {"the usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB)": 16.0, "Colab (T4)": 12.7,
                           "Kaggle (T4)": 29.0, "a host between": 20.0}},
}


def test_the_section_labels_each_figure_and_states_the_depth_was_not_measured():
    text = realsize.markdown(REPORT)  # the command's renderer takes both kinds of report
    assert text.startswith("Measured 2026-12-02 on x86_64 CPU") and f"`{REPORT['command']}`" in text
    assert "fp16 with dynamic loss scaling, ZeRO-2, the optimizer offloaded to CPU: DeepSpeed's CPU Adam" in text
    assert "the vocabulary of 32,000 its training tokenizer has (`bpe:32000`; the embedded tokenizer" in text
    assert "| 2 | 2,000 / 2,000 | 4.50 GiB | 0.75 GiB + 3.50 GiB = 4.25 GiB | -5.6% |" in text
    assert "| 4 | 0.25 GiB | 1.50 GiB | 2.00 GiB | 6.25 GiB |" in text
    assert "2.75 GiB + 0.88 GiB per layer (residuals: 2 layers +0.000 GiB, 4 layers +0.000 GiB)" in text
    assert "At the preset's 22 layers, which were **not measured**:" in text
    assert "| fitted (extrapolated from 2, 4 layers) | 22.00 GiB |" in text
    assert "| projected (device + host) | 3.50 GiB + 17.00 GiB = 20.50 GiB |" in text
    assert "in host RAM, 18.50 GiB per GPU (projected)" in text


def test_the_host_question_is_answered_from_the_fit_and_the_projection():
    """A host at least the fitted one-RAM peak fits (that peak bounds the host's part from above); one below the
    projected host part does not; one between the two fits the projection only, and says so."""
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in realsize.markdown(REPORT).splitlines()
            if line.startswith("| ")}
    assert "**does not fit**: the projected host part alone is more" in rows["Colab (T4)"]
    assert "| 12.7 GiB |" in rows["Colab (T4)"]
    assert "fits: the fitted one-RAM peak is within it" in rows["Kaggle (T4)"]
    assert "**does not fit**" in rows["the usual t4 host, AWS g4dn.xlarge (1 GPU, 16 GiB)"]
    assert "fits the projected host part; the fitted one-RAM peak is more" in rows["a host between"]


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
])
def test_bad_flags_are_refused_in_one_line_before_anything_is_measured(flags, message, monkeypatch):
    def measured(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(realsize.realsize_width, "run_width_benchmark", measured)
    monkeypatch.setattr(realsize, "run_benchmark", measured)
    with pytest.raises(SystemExit) as raised:
        realsize.main(flags)
    assert str(raised.value).startswith(f"error: {message}") and "\n" not in str(raised.value)


def test_a_ds_config_that_names_no_preset_needs_one(tmp_path, monkeypatch):
    (tmp_path / "engine.json").write_text('{"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": true}}')
    monkeypatch.setattr(realsize.realsize_width, "run_width_benchmark", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit, match=r"^error: .*engine\.json names no preset: pass --preset \(debug, "):
        realsize.main(["--layers", "1", "2", "--ds_config", str(tmp_path / "engine.json")])
