"""A grid report pins its corpus and states its compute: the data's hash is recorded and shown in its section,
--extend refuses a report whose recorded hash is not its --data's, an earlier report without one is extended with
its seeds marked unchecked, and the section states the CPU-hours its runs spent."""

import json

import pytest
from helpers.pilots import prepared_dir

from adaptive_ds.data.identity import data_identity
from adaptive_ds.tools.grid import assemble, check_extension, main
from adaptive_ds.tools.grid_spec import GridSpec, parse_variant
from adaptive_ds.tools.grid_tables import markdown

TRAINED = {"commit": "abc1234", "machine": "x86_64 CPU, 2 cores, no GPU", "date": "2026-12-02"}


def _finished(variant: str, seed: int, wall_time_s: float) -> dict:
    """A finished run as load_run reads it, its curve (FLOPs, loss, tokens, training seconds) of two steps."""
    curve = [(1e12, 3.0, 1000, 2.0), (2e12, 2.0 + seed / 10, 2000, 10.0)]
    phases = {"setup": 2.0, "data": 1.0, "train": 6.0, "checkpoint": 0.5, "eval": 0.4, "other": 0.1}
    summary = {"validation_loss": 2.0 + seed / 10, "validation_loss_se": 0.01, "tokens_seen": 2000,
               "wall_time_s": wall_time_s, "time_breakdown_s": phases, "total_parameters": 1000,
               "active_parameters": 1000, "peak_memory": {"device": "cpu", "peak_rss_bytes": 2**30}}
    metrics = [{"loss": c[1], "tokens_seen": c[2], "elapsed_s": c[3] + 2.0} for c in curve]
    return {"variant": variant, "seed": seed, "run_dir": f"{variant}-{seed}", "kept": False, "trained": TRAINED,
            "summary": summary, "metrics": metrics, "curve": curve}


def _spec(data: str, seeds=(1, 2)) -> GridSpec:
    return GridSpec("debug", (parse_variant("dense"),), seeds, 2000, "ds_configs/debug_cpu.json", data=data)


def test_the_section_states_the_corpus_hash_and_the_cpu_hours(tmp_path):
    corpus = prepared_dir(tmp_path / "docs")
    spec = _spec(corpus)
    # 1800 s + 5400 s of wall time: 2.00 CPU-hours
    report = assemble(spec, [_finished("dense", 1, 1800.0), _finished("dense", 2, 5400.0)], [], None, None, None,
                      data_hash=data_identity(corpus))
    assert report["data_hash"] == data_identity(corpus) and report["data_hash"]["sha256"] is not None
    text = markdown(report)
    assert (f"Corpus: data sha256 `{report['data_hash']['sha256']}` (prepared directory: its 3 token shards (43 "
            "tokens) and its tokenizer). Compute: 2.00 CPU-hours (the wall times of its 2 finished runs summed, one "
            "process each).") in text
    old = {k: v for k, v in report.items() if k != "data_hash"}  # a report from before the hash
    assert "Corpus: data hash not recorded. Compute: 2.00 CPU-hours" in markdown(old)
    hub = markdown({**report, "data_hash": data_identity("allenai/c4")})
    assert "Corpus: no data hash: 'allenai/c4' is a Hub dataset, streamed: its revision is not pinned" in hub


def test_extend_refuses_a_report_of_another_corpus_and_marks_an_unhashed_ones_seeds(tmp_path):
    corpus = prepared_dir(tmp_path / "docs")
    spec = _spec(corpus, seeds=(1, 2, 3))
    earlier = assemble(_spec(corpus), [_finished("dense", 1, 60.0), _finished("dense", 2, 60.0)], [], None, None,
                       None, data_hash=data_identity(corpus))
    check_extension(spec, earlier, data_identity(corpus))  # the same corpus: accepted
    # the same path prepared again from other text: refused, naming both hashes
    again = prepared_dir(tmp_path / "again", train=tuple(range(1, 41)))
    with pytest.raises(ValueError, match=rf"its data hashed sha256 {earlier['data_hash']['sha256']}, --data .*docs "
                                         rf"now hashes {data_identity(again)['sha256']}: the new seeds would train on "
                                         "another corpus"):
        check_extension(spec, earlier, data_identity(again))
    unhashed = {k: v for k, v in earlier.items() if k != "data_hash"}
    check_extension(spec, unhashed, data_identity(corpus))  # nothing to check against: accepted
    extended = assemble(spec, [_finished("dense", 3, 60.0)], [], None, None, None, extend=unhashed,
                        data_hash=data_identity(corpus))
    assert extended["data_hash"] == {**data_identity(corpus), "unchecked_seeds": [1, 2]}
    assert "; seeds 1, 2 were trained before the data hash was recorded, so their corpus is unchecked. Compute: " \
           "0.05 CPU-hours (the wall times of its 3 finished runs summed" in markdown(extended)
    # extended again: seeds 1 and 2 stay unchecked
    again = assemble(_spec(corpus, seeds=(1, 2, 3, 4)), [_finished("dense", 4, 60.0)], [], None, None, None,
                     extend=extended, data_hash=data_identity(corpus))
    assert again["data_hash"]["unchecked_seeds"] == [1, 2] and len(again["runs"]) == 4


def test_the_command_refuses_to_extend_with_another_corpus_before_training(tmp_path, capsys):
    report = tmp_path / "grid.json"
    common = ["--variants", "dense", "--tokens", "2000", "--data", "embedded", "--runs", str(tmp_path / "runs"),
              "--out", str(tmp_path / "out")]
    spec = GridSpec("debug", (parse_variant("dense"),), (1,), 2000, "ds_configs/debug_cpu.json")
    earlier = assemble(spec, [_finished("dense", 1, 60.0)], [], None, None, None,
                       data_hash={"sha256": "0" * 64, "of": "the embedded generator (base tier)"})
    report.write_text(json.dumps(earlier))
    with pytest.raises(SystemExit) as refused:
        main([*common, "--seeds", "1", "2", "--extend", str(report)])
    assert str(refused.value.code).startswith(f"error: --extend {report}: its data hashed sha256 {'0' * 64}, --data "
                                              f"embedded now hashes {data_identity('embedded')['sha256']}")
    assert "\n" not in str(refused.value.code) and not (tmp_path / "runs").exists()
