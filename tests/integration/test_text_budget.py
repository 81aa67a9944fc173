"""The text budget end to end: a real pilot trained on a small prepared corpus, its validation curve read from the
run's own files, and the same command keeping the finished pilot."""

import json
import os

import pytest
from helpers.corpora import prepared

from adaptive_ds.data.identity import data_identity
from adaptive_ds.tools.text_budget import main, markdown


@pytest.mark.slow  # one real training run of 12 steps
def test_a_pilot_is_trained_read_and_kept(tmp_path, tiny_ds_config, capsys):
    corpus = prepared(tmp_path, seq_len=256)
    config = tiny_ds_config(micro=2, log_steps=4)  # 2 x 256 = 512 tokens a step
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--data", corpus, "--ds_config", config, "--max_tokens", "6144", "--evaluations", "6", "--eval_batches",
            "1", "--min_points", "3", "--threshold", "0.05", "--work", str(work), "--out", str(out)]
    main(argv)
    report = json.loads((out / "text-budget_debug_prep.json").read_text())
    run_dir = work / report["run_dir"]  # recorded relative to --work
    # 12 steps, a validation every 2 steps (6 evaluations): the run's own validation losses, at step x 512 tokens
    with open(run_dir / "metrics.jsonl") as f:
        validated = [(r["step"], r["validation_loss"]) for r in map(json.loads, f) if "validation_loss" in r]
    assert [(r["step"], r["validation_loss"]) for r in report["curve"]] == validated
    assert [r["tokens"] for r in report["curve"]] == [1024 * k for k in range(1, 7)]
    assert report["max_tokens"] == 6144 and report["eval_steps"] == 2 and report["tokens_per_step"] == 512
    assert report["data_hash"] == data_identity(corpus) and report["commit"] != "unknown"
    assert report["ds_config"] == config and f"--ds_config {config}" in report["command"]
    assert report["proposed_tokens"] in [r["tokens"] for r in report["curve"]]
    assert capsys.readouterr().out.startswith(markdown(report))
    # the same command again: the pilot is kept, not trained again, and gives the same report
    modified = os.stat(run_dir / "summary.json").st_mtime_ns
    main(argv)
    assert os.stat(run_dir / "summary.json").st_mtime_ns == modified
    assert json.loads((out / "text-budget_debug_prep.json").read_text()) == report
