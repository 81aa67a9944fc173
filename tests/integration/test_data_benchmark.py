"""The data pipeline benchmark at its smallest settings: its JSON report under the runs directory by default, the
GPU configs' needs computed by the planner, and the repository's committed results only when told, as a section
rendered from the report."""

import json
import os
import re
import shutil

import pytest
from helpers.common import ROOT, snapshot

from adaptive_ds.tools import data_benchmark
from adaptive_ds.tools.data_benchmark import main, markdown
from adaptive_ds.tools.plan import SCENARIOS, plan_config


@pytest.mark.slow  # builds, prepares and streams a small corpus, with DataLoader worker processes
def test_the_data_benchmark_reports_under_runs_and_publishes_only_when_told(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    name = "throughput_debug_cpu.json"
    (tmp_path / "benchmarks" / name).write_bytes((ROOT / "benchmarks" / name).read_bytes())
    (tmp_path / "BENCHMARKS.md").write_bytes((ROOT / "BENCHMARKS.md").read_bytes())
    shutil.copytree(ROOT / "ds_configs", tmp_path / "ds_configs")  # the repository's root, as README runs it
    before_md, before_results = (tmp_path / "BENCHMARKS.md").read_bytes(), snapshot(tmp_path / "benchmarks")
    argv = ["--corpus_mb", "3", "--files", "2", "--steps", "2"]
    main(argv)
    assert (tmp_path / "BENCHMARKS.md").read_bytes() == before_md
    assert snapshot(tmp_path / "benchmarks") == before_results
    report = json.loads((tmp_path / "runs" / "data_benchmark" / "data_benchmark.json").read_text())
    assert report["command"] == "python -m adaptive_ds.tools.data_benchmark " + " ".join(argv)
    assert report["corpus_files"] == 2 and report["corpus_tokens"] > 0
    for pipeline in ("streaming_0_workers", "streaming_1_workers", "streaming_2_workers", "prepared_0_workers",
                     "prepared_2_workers"):
        assert report["results"][pipeline]["tokens_per_s"] > 0, pipeline
    # each shipped GPU config's need is the planner's projection, computed when the benchmark ran
    needs = {(n["preset"], n["arch"], n["config"]): n["projected_tokens_per_s"] for n in report["gpu_needs"]}
    assert len(needs) == sum(len(archs) for _, archs, _, _ in SCENARIOS)
    preset, archs, gpu, config = SCENARIOS[-1]
    assert needs[(preset, archs[0], config)] == plan_config(preset, archs[0], gpu,
                                                            os.path.join(ROOT, "ds_configs", config)
                                                            ).tokens_per_s_projected

    # published: the same measurements (not taken again: what is under test is where they go), the section
    # rendered from the report alone
    measured = {k: report[k] for k in ("corpus_files", "corpus_tokens", "vocab_size", "results")}
    monkeypatch.setattr(data_benchmark, "measure", lambda work, steps: measured)
    main([*argv, "--out", "benchmarks", "--benchmarks_md", "BENCHMARKS.md"])
    published = json.loads((tmp_path / "benchmarks" / "data_benchmark.json").read_text())
    assert published["results"] == report["results"]
    text = (tmp_path / "BENCHMARKS.md").read_text()
    section = re.search(r"<!-- data:benchmark -->\n(.*)\n<!-- /data:benchmark -->", text, flags=re.S).group(1)
    assert section == markdown(published)
    rate = published["results"]["prepared_2_workers"]["tokens_per_s"]
    assert f"| {rate:,.0f} |" in section
    fastest = max(published["gpu_needs"], key=lambda n: n["projected_tokens_per_s"])
    assert f"{rate / fastest['projected_tokens_per_s']:,.1f}x" in section
    assert (tmp_path / "benchmarks" / name).read_bytes() == before_results[name]
