"""The quick-start timing tool's section and its reading of a command's output (hand-made reports)."""

from adaptive_ds.tools.quickstart import last_lines, markdown

REPORT = {"date": "2026-12-01", "machine": "x86_64 CPU, 2 cores, no GPU", "cpu": "Some CPU", "memory_gib": 24,
          "commit": "abc1234", "command": "python -m adaptive_ds.tools.quickstart --out benchmarks",
          "results": [
              {"command": "make train", "wall_s": 150.0, "exit_status": 0, "load_average_at_start": 0.5,
               "last_lines": ["train: 100%|###| 3/3", "final loss 4.2 | ok", "done `x`"]},
              {"command": "make test", "wall_s": 5400.0, "exit_status": None, "load_average_at_start": 2.25,
               "last_lines": ["....."]}]}


def test_the_section_shows_each_command_with_its_minutes_status_and_last_lines():
    text = markdown(REPORT)
    assert text.startswith("Measured 2026-12-01 on x86_64 CPU, 2 cores, no GPU (Some CPU, 24 GiB), commit abc1234: "
                           "`python -m adaptive_ds.tools.quickstart --out benchmarks`.")
    rows = [line for line in text.splitlines() if line.startswith("| `make")]
    assert rows == ["| `make train` | 2.5 minutes | 0 | 0.50 | `train: 100%/###/ 3/3`<br>`final loss 4.2 / ok`<br>"
                    "`done x` |",
                    "| `make test` | 90.0 minutes | timed out | 2.25 | `.....` |"]


def test_last_lines_are_what_a_terminal_shows():
    output = "setup\n\nepoch 1\rtrain:  50%\rtrain: 100%\nsaved final/\n\n"
    assert last_lines(output) == ["setup", "train: 100%", "saved final/"]
    assert last_lines("a\nb\nc\nd\n", 2) == ["c", "d"]
