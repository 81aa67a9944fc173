"""The command `make setup` runs to build DeepSpeed's ops once (adaptive_ds/tools/build_ops.py): its report's section,
and a report asked of a build from the cache refused in one line before anything loads."""

import pytest

from adaptive_ds.tools import build_ops


def _report(**second) -> dict:
    results = [{"op": "cpu_adam", "needed_by": "an optimizer offloaded to the CPU", "wall_s": 163.4,
                "compiler_cpu_s": 82.5, "load_average_at_start": 4.41, "ok": True},
               {"op": "fused_adam", "needed_by": "Adam without offload", "wall_s": 100.0, "compiler_cpu_s": 60.0,
                "load_average_at_start": 6.0, "ok": True, **second}]
    return {"date": "2026-12-02", "machine": "x86_64 CPU, 2 cores, no GPU", "cpu": "AMD EPYC", "memory_gib": 24,
            "torch": "2.13.0+cpu", "deepspeed": "0.19.8", "compiler": "c++ (Debian 12.2.0-14) 12.2.0",
            "commit": "abc1234", "command": "python -m adaptive_ds.tools.build_ops --fresh", "results": results}


def test_the_section_has_a_row_per_op_and_their_total():
    lines = build_ops.markdown(_report()).splitlines()
    assert lines[0].startswith("Measured 2026-12-02 on x86_64 CPU, 2 cores, no GPU (AMD EPYC, 24 GiB), torch "
                               "2.13.0+cpu")
    assert "commit abc1234: `python -m adaptive_ds.tools.build_ops --fresh`" in lines[0]
    assert lines[-3:] == ["| `cpu_adam` | an optimizer offloaded to the CPU | 163 s | 82 s | 4.41 |",
                          "| `fused_adam` | Adam without offload | 100 s | 60 s | 6.00 |",
                          "| all | `make setup`, once | 263 s | 142 s | |"]


def test_a_failed_build_is_shown_as_failed_with_its_error():
    text = build_ops.markdown(_report(ok=False, error="RuntimeError: Error building extension 'fused_adam'"))
    assert "| 100 s (**failed**: RuntimeError: Error building extension 'fused_adam') |" in text


@pytest.mark.parametrize("argv", [["--out", "benchmarks"], ["--benchmarks_md", "BENCHMARKS.md"]])
def test_a_report_of_a_build_from_the_cache_is_refused_in_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        build_ops.main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--out and --benchmarks_md report a build from nothing: add --fresh (loading built ops measures nothing)")
