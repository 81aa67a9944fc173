"""The ds_configs ship with the package (adaptive_ds/ds_configs, package data): `--ds_config NAME.json`, or
`ds_configs/NAME.json` as the documented commands write it, reads the shipped config wherever the command runs;
a path that exists is read as given; the repository's ds_configs/ is the package's folder, one copy."""

import json
import os

import pytest
from helpers.common import ROOT

from adaptive_ds import ds_config as reader
from adaptive_ds.tools import acceptance, data_benchmark, grid, plan
from adaptive_ds.training.arguments import ConfigError, parse

SHIPPED = ROOT / "adaptive_ds" / "ds_configs"


def test_the_configs_live_in_the_package_and_the_repository_folder_is_the_same_one():
    names = sorted(p.name for p in SHIPPED.glob("*.json"))
    assert {"debug_cpu.json", "b1_t4.json", "b7_8gpu.json"} <= set(names)
    assert reader.shipped() == names
    assert os.path.samefile(ROOT / "ds_configs", SHIPPED)  # the documented commands' path, not a second copy


@pytest.mark.parametrize("given", ["b1_t4.json", "ds_configs/b1_t4.json"])
def test_a_shipped_name_resolves_from_any_working_directory(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ds_configs/ here
    assert os.path.samefile(reader.resolve(given), SHIPPED / "b1_t4.json")
    assert reader.load(given) == json.loads((SHIPPED / "b1_t4.json").read_text())
    settings, _ = parse(["--ds_config", given], world_size=1)
    assert settings.preset == "b1"


def test_a_path_that_exists_is_read_as_given(tmp_path, monkeypatch):
    own = {"adaptive_ds": {"preset": "debug"}, "train_micro_batch_size_per_gpu": 3}
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "b1_t4.json").write_text(json.dumps(own))
    (tmp_path / "debug_cpu.json").write_text(json.dumps(own))
    monkeypatch.chdir(tmp_path)
    assert reader.load("ds_configs/b1_t4.json") == own and reader.load("debug_cpu.json") == own
    assert reader.resolve(str(tmp_path / "debug_cpu.json")) == str(tmp_path / "debug_cpu.json")


@pytest.mark.parametrize("given", ["b9_t4.json", "elsewhere/b1_t4.json", "b1_t4"])
def test_anything_else_not_found_names_the_shipped_configs(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        reader.load(given)
    message = str(error.value)
    assert message.startswith(f"ds_config {given!r} does not exist") and "\n" not in message
    assert ", ".join(reader.shipped()) in message


@pytest.mark.parametrize("main", [plan.main, grid.main, lambda argv: parse(argv, world_size=1)],
                         ids=["plan", "grid", "train"])
def test_each_command_taking_a_ds_config_says_a_shipped_name_is_enough(main, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "a path, or the name of a shipped config" in " ".join(capsys.readouterr().out.split())


def test_the_planner_and_the_acceptance_run_read_the_shipped_configs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    plan.main(["--preset", "b1", "--gpu", "t4", "--ds_config", "b1_t4.json"])
    assert "b1 dense on 1 x t4" in capsys.readouterr().out
    config = acceptance._ds_config("b1_t4.json", dry=False)
    assert config["gradient_accumulation_steps"] == 1 and config["zero_optimization"]["stage"] == 2
    assert "`b1_t4.json`" in plan.projections_markdown()  # every shipped GPU config, planned
    assert {need["config"] for need in data_benchmark.gpu_needs()} >= {"b1_t4.json", "b7_8gpu.json"}


def test_what_only_a_checkout_holds_is_refused_in_one_line_where_it_is_absent(tmp_path, monkeypatch):
    """An installed wheel holds the configs but not the repository's tests and measured peaks: the acceptance run's
    GPU-tests stage and the planner's validation say so in one line (the other stages and plans still run)."""
    monkeypatch.setattr(acceptance, "ROOT", tmp_path)  # where an installed package has no tests/ beside it
    result = acceptance.stage_gpu_tests(dry=True, workdir=tmp_path)
    assert not result["ok"] and result["error"].startswith(f"{acceptance.GPU_TESTS} is not beside the package")
    assert "--stages b1_t4 benchmark b7" in result["error"] and "\n" not in result["error"]
    monkeypatch.setattr(plan, "BENCHMARKS_DIR", tmp_path / "benchmarks")
    monkeypatch.setattr(plan, "EXTERNAL", tmp_path / "benchmarks" / "external")
    with pytest.raises(SystemExit, match=r"^error: no external reference figures .* from a checkout of the "
                                         r"repository$"):
        plan.main(["--validate"])
