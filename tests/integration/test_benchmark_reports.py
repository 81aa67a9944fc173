"""What the throughput and generation benchmarks write: a JSON report under the runs directory by default, and
the repository's committed results (benchmarks/, BENCHMARKS.md) only when told, as sections rendered from that
report."""

import json
import re

from helpers.common import ROOT, snapshot

from adaptive_ds.tools import benchmark
from adaptive_ds.tools.benchmark import generation_markdown, main, markdown
from adaptive_ds.tools.staleness import unlabelled


def _published_copy(tmp_path, monkeypatch) -> tuple[bytes, dict[str, bytes]]:
    """The repository's BENCHMARKS.md and benchmarks/ copied into a working directory that the test moves into."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    for name in ("throughput_debug_cpu.json", "grid_debug_embedded-hard.json"):
        (tmp_path / "benchmarks" / name).write_bytes((ROOT / "benchmarks" / name).read_bytes())
    (tmp_path / "BENCHMARKS.md").write_bytes((ROOT / "BENCHMARKS.md").read_bytes())
    return (tmp_path / "BENCHMARKS.md").read_bytes(), snapshot(tmp_path / "benchmarks")


def _section(path, key: str) -> str:
    text = path.read_text()
    return re.search(f"<!-- {re.escape(key)} -->\n(.*)\n<!-- /{re.escape(key)} -->", text, flags=re.S).group(1)


def test_throughput_is_published_only_when_told(tmp_path, monkeypatch):
    before_md, before_results = _published_copy(tmp_path, monkeypatch)
    argv = ["--preset", "debug", "--steps", "1", "--rounds", "1", "--warmup", "1", "--micro_batch", "2",
            "--precision", "fp32", "--cases", "dense", "mod"]
    main(argv)
    assert (tmp_path / "BENCHMARKS.md").read_bytes() == before_md
    assert snapshot(tmp_path / "benchmarks") == before_results
    report = json.loads((tmp_path / "runs" / "benchmark" / "throughput_debug_cpu.json").read_text())
    assert set(report["results"]) == {"dense", "mod"} and "--cases dense mod" in report["command"]
    assert report["warmup_steps"] == report["steps_per_round"] == 1 and report["rounds"] == 1  # --warmup as given
    assert report["ratio_rounds"]["mod/dense"] == [report["results"]["mod"]["rounds"][0] /
                                                  report["results"]["dense"]["rounds"][0]]

    # the same report published (not measured again: what is under test is where it goes)
    monkeypatch.setattr(benchmark, "run_benchmark", lambda *args, **kwargs: report)
    main([*argv, "--out", "benchmarks", "--benchmarks_md", "BENCHMARKS.md"])
    published = json.loads((tmp_path / "benchmarks" / "throughput_debug_cpu.json").read_text())
    assert published == report
    # under the label its commit gets (run outside the checkout: "unknown", whose staleness cannot be told)
    assert unlabelled(_section(tmp_path / "BENCHMARKS.md", "throughput:debug:cpu")) == markdown(published)
    assert (tmp_path / "benchmarks" / "grid_debug_embedded-hard.json").read_bytes() == before_results[
        "grid_debug_embedded-hard.json"]


def test_generation_is_a_report_and_a_section_of_its_own(tmp_path, monkeypatch):
    before_md, before_results = _published_copy(tmp_path, monkeypatch)
    argv = ["--generate", "--preset", "debug", "--cases", "dense", "mod", "--micro_batch", "1", "--prompt_len", "4",
            "--new_tokens", "3", "--rounds", "1"]
    main(argv)
    assert (tmp_path / "BENCHMARKS.md").read_bytes() == before_md
    assert snapshot(tmp_path / "benchmarks") == before_results
    report = json.loads((tmp_path / "runs" / "benchmark" / "generate_debug_cpu_batch1.json").read_text())
    assert set(report["results"]) == {"dense", "mod"} and report["command"].startswith(
        "python -m adaptive_ds.tools.benchmark --generate --preset debug")

    monkeypatch.setattr(benchmark, "measure_generation", lambda *args, **kwargs: report)
    main([*argv, "--out", "benchmarks", "--benchmarks_md", "BENCHMARKS.md"])
    published = json.loads((tmp_path / "benchmarks" / "generate_debug_cpu_batch1.json").read_text())
    assert published == report
    section = unlabelled(_section(tmp_path / "BENCHMARKS.md", "generate:debug:cpu:batch1"))
    assert section == generation_markdown(published)
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| `")}
    assert set(rows) == {"`dense`", "`mod`"}
    dense = published["results"]["dense"]["tokens_per_s"]
    assert f"| {dense:,.1f} |" in rows["`dense`"]  # the JSON's figure, as the section formats it
    assert _section(tmp_path / "BENCHMARKS.md", "throughput:debug:cpu") in before_md.decode()  # left alone
