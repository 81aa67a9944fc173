import json

import pytest
from conftest import DEBUG_CPU, run_command

from adaptive_ds.training.arguments import ConfigError, parse


def _config(tmp_path, **changes):
    with open(DEBUG_CPU) as f:
        config = json.load(f)
    for key, value in changes.items():
        if key == "block":
            config["adaptive_ds"].update(value)
        else:
            config[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_block_is_removed_and_flags_override_it():
    settings, ds_config = parse(["--ds_config", DEBUG_CPU, "--arch", "moe", "--max_steps", "7", "--seed", "3",
                                 "--warmup_steps", "2"], 1)
    assert "adaptive_ds" not in ds_config
    assert (settings.preset, settings.arch, settings.max_steps, settings.seed) == ("debug", "moe", 7, 3)
    assert settings.warmup_steps == 2  # the block says 30
    assert ds_config["optimizer"]["params"]["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("argv_extra, config_changes, message", [
    (["--preset", "b3"], {}, "unknown preset 'b3'; valid choices: debug, debug_200m, b1, b7"),
    (["--arch", "sparse"], {}, "unknown arch 'sparse'; valid choices: dense, moe, mod, hybrid"),
    ([], {"block": {"learning_rate": 1}}, "unknown key(s) learning_rate in the 'adaptive_ds' block"),
    ([], {"train_batch_size": 7}, "train_batch_size 7 != train_micro_batch_size_per_gpu 16"),
    ([], {"train_micro_batch_size_per_gpu": 0}, "batch sizes must be positive integers"),
    (["--data", "/no/such/corpus.txt"], {}, "data path '/no/such/corpus.txt' does not exist"),
    ([], {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
    ([], {"block": {"model": {"hidden": 3}}}, "unknown model field(s) hidden"),
    (["--gpu_memory_gib", "-1"], {}, "gpu_memory_gib must be > 0, got -1.0"),
    (["--warmup_steps", "-5"], {}, "warmup_steps must be >= 0, got -5"),
])
def test_bad_input_names_the_problem(tmp_path, argv_extra, config_changes, message):
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", _config(tmp_path, **config_changes), *argv_extra], 1)
    assert message in str(error.value)


def test_batch_sizes_are_checked_against_the_world_size(tmp_path):
    path = _config(tmp_path, train_batch_size=32)
    parse(["--ds_config", path], 2)
    with pytest.raises(ConfigError, match="x world size 1 = 16"):
        parse(["--ds_config", path], 1)


def test_broken_and_missing_json(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_micro_batch_size_per_gpu": 4,')
    with pytest.raises(ConfigError, match="is not valid JSON"):
        parse(["--ds_config", str(broken)], 1)
    with pytest.raises(ConfigError, match="does not exist"):
        parse(["--ds_config", str(tmp_path / "none.json")], 1)


@pytest.mark.slow
def test_launcher_exits_with_one_line_and_leaves_outputs_alone(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("earlier run")
    for extra in (["--preset", "b3"], []):  # a bad preset; then a good config into a used directory
        result = run_command(["python", "launchers/train.py", "--ds_config", DEBUG_CPU, "--output_dir", str(out),
                              *extra], timeout=300)
        assert result.returncode != 0
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and ("valid choices" in last or "already holds files" in last)
        assert "Traceback" not in result.stderr
        assert sorted(p.name for p in out.iterdir()) == ["summary.json"]
        assert (out / "summary.json").read_text() == "earlier run"


@pytest.mark.gpu
def test_the_gpu_memory_cap_makes_larger_allocations_fail():
    import torch

    from adaptive_ds.training.loop import _cap_gpu_memory

    _cap_gpu_memory(1.0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        torch.empty(2**29, dtype=torch.uint8, device="cuda")  # half a GiB still fits
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
