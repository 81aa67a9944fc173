"""Run settings: the ds_config's block and the flags parsed and validated as a whole, every problem named in one
line, named variants and their old spellings, and docs/training.md's settings table generated from the dataclass."""

import json
import re
import sys
from dataclasses import fields

import pytest
import torch
from helpers.common import DEBUG_CPU, ROOT, debug_cpu_config
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_ds import data
from adaptive_ds.models.configuration import AdaptiveDSConfig
from adaptive_ds.presets import MOD_FIELDS, MOE_FIELDS, model_config
from adaptive_ds.training.arguments import ConfigError, RunSettings, build_parser, parse, settings_markdown


def test_block_is_removed_and_flags_override_it():
    settings, ds_config = parse(["--ds_config", DEBUG_CPU, "--arch", "moe", "--max_steps", "7", "--seed", "3",
                                 "--warmup_steps", "2"], 1)
    assert "adaptive_ds" not in ds_config
    assert (settings.preset, settings.arch, settings.max_steps, settings.seed) == ("debug", "moe", 7, 3)
    assert settings.warmup_steps == 2  # the block says 30
    assert ds_config["optimizer"]["params"]["betas"] == [0.9, 0.95]


def test_every_setting_has_its_flag_and_nothing_else_does():
    options = {o for action in build_parser()._actions for o in action.option_strings}
    settings = {f"--{f.name}" for f in fields(RunSettings)}
    assert settings <= options
    negations = {"--no-compile", "--no-push_every_save", "--no-activation_checkpointing"}  # the booleans
    assert options - settings == {"-h", "--help", "--ds_config", "--ep_size", "--local_rank"} | negations


def test_flags_that_only_the_block_had_before_override_it(tmp_path):
    path = debug_cpu_config(tmp_path, block={"arch": "moe", "compile": True,
                                             "model": {"moe_ep_size": 1, "router_aux_loss_coef": 0.02}})
    settings, _ = parse(["--ds_config", path, "--text_field", "body", "--min_lr_ratio", "0.05", "--log_steps", "3",
                         "--no-compile", "--tokens", "5000", "--model", '{"router_aux_loss_coef": 0.05}',
                         "--controller", '{"spike_sigma": 4}', "--ep_size", "1"], 1)
    assert (settings.text_field, settings.min_lr_ratio, settings.log_steps) == ("body", 0.05, 3)
    assert settings.compile is False and settings.tokens == "5000"
    assert settings.model == {"moe_ep_size": 1, "router_aux_loss_coef": 0.05}  # merged: the block's ep stays
    assert settings.controller == {"spike_sigma": 4}
    untouched, _ = parse(["--ds_config", path], 1)
    assert untouched.compile is True and untouched.log_steps == 20


def test_the_training_page_holds_the_generated_settings_table():
    page = (ROOT / "docs" / "training.md").read_text()
    table = re.search(r"<!-- settings -->\n(.*?)\n<!-- /settings -->", page, flags=re.S)
    assert table, "docs/training.md has no <!-- settings --> section"
    assert table.group(1) == settings_markdown(), (
        "docs/training.md's settings table is stale; run: python -c \"from adaptive_ds.training.arguments import "
        "write_settings_table; write_settings_table('docs/training.md')\"")
    rows = [line for line in table.group(1).splitlines()[2:]]
    assert len(rows) == len(fields(RunSettings))
    assert "| `max_steps` / `--max_steps` | integer | `100` |" in table.group(1)
    assert "| `model` / `--model` | object | `{}` |" in table.group(1)


@pytest.mark.parametrize("argv_extra, config_changes, message", [
    (["--preset", "b3"], {}, "unknown preset 'b3'; valid choices: debug, debug_200m, b1, b7"),
    (["--arch", "sparse"], {}, "unknown arch 'sparse'; valid choices: dense, moe, mod, hybrid"),
    ([], {"block": {"learning_rate": 1}}, "unknown key(s) learning_rate in the 'adaptive_ds' block"),
    ([], {"train_batch_size": 7}, "train_batch_size 7 != train_micro_batch_size_per_gpu 16"),
    ([], {"train_micro_batch_size_per_gpu": 0}, "batch sizes must be positive integers"),
    (["--data", "/no/such/corpus.txt"], {}, "data path '/no/such/corpus.txt' does not exist"),
    ([], {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled"),
    ([], {"block": {"model": {"hidden": 3}}}, "unknown model field(s) hidden"),
    (["--model", '{"config_version": 1}'], {}, "model field config_version is a saved config's own"),
    (["--model", '{"vocab_size": 32000}'], {}, "model field vocab_size is the tokenizer's (its length, padded)"),
    (["--gpu_memory_gib", "-1"], {}, "gpu_memory_gib must be > 0, got -1.0"),
    (["--warmup_steps", "-5"], {}, "warmup_steps must be >= 0, got -5"),
    # types of the block's values, named with what they must be
    ([], {"block": {"max_steps": "10"}}, "max_steps must be an integer, got '10'"),
    ([], {"block": {"compile": "yes"}}, "compile must be true or false, got 'yes'"),
    ([], {"block": {"min_lr_ratio": "0.1"}}, "min_lr_ratio must be a number, got '0.1'"),
    ([], {"block": {"data_config": 3}}, "data_config must be a string or null, got 3"),
    ([], {"block": {"model": [1]}}, "model must be an object, got [1]"),
    ([], {"block": {"tokens": "lots"}}, "tokens 'lots' is not a positive whole number or 'chinchilla'"),
    (["--resume", "sometimes"], {}, "unknown resume 'sometimes'; valid choices: auto, never"),
    (["--report_to", "mlflow"], {}, "unknown report_to 'mlflow'; valid choices: none, tensorboard, wandb"),
    # model overrides: checked by building the configuration the run would build
    (["--arch", "mod"], {"block": {"model": {"mod_capacity": 2}}},
     "model: invalid AdaptiveDSConfig: mod_capacity must be in (0, 1], got 2"),
    ([], {"block": {"model": {"mod_capacity": "half"}}}, "model.mod_capacity must be a number or null, got 'half'"),
    (["--arch", "moe", "--ep_size", "3"], {},
     "the 8 routed experts (num_local_experts x moe_expert_granularity) are not divisible by moe_ep_size 3"),
    (["--arch", "moe", "--ep_size", "2"], {}, "moe_ep_size 2 does not divide the world size 1"),
    (["--model", '{"num_attention_heads": 0}'], {}, "num_attention_heads must be >= 1, got 0"),
    ([], {"block": {"controller": {"spike_sigma": "high"}}}, "controller.spike_sigma must be a number, got 'high'"),
    ([], {"block": {"controller": {"mod_capacity_bounds": [0.5]}}}, "controller.mod_capacity_bounds must be a list"),
    ([], {"block": {"controller": {"sigma": 1}}}, "unknown controller key(s) sigma"),
    # the ds_config's own sections
    ([], {"zero_optimization": {"stage": 4}}, "zero_optimization.stage 4 is not one of 0, 1, 2, 3"),
    ([], {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "offload_param needs ZeRO stage 3"),
    ([], {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}},
     "offload_optimizer.device 'disk' is not one of none, cpu, nvme"),
])
def test_bad_input_names_the_problem(tmp_path, argv_extra, config_changes, message):
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", debug_cpu_config(tmp_path, **config_changes), *argv_extra], 1)
    assert message in str(error.value)


def test_every_problem_is_named_in_one_line(tmp_path):
    path = debug_cpu_config(tmp_path, block={"max_steps": "10", "preset": "b3", "model": {"mod_capacity": "x"}})
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", path, "--keep_last", "0"], 1)
    message = str(error.value)
    assert "\n" not in message
    for part in ("max_steps must be an integer", "unknown preset 'b3'", "keep_last must be >= 1, got 0"):
        assert part in message


@pytest.mark.parametrize("reporter", ["wandb", "tensorboard"])
def test_a_reporter_without_its_package_fails_at_validation(tmp_path, monkeypatch, reporter):
    # a None entry in sys.modules is how Python marks a module as not importable: find_spec then finds nothing
    monkeypatch.setitem(sys.modules, reporter, None)
    with pytest.raises(ConfigError, match=f"report_to {reporter} needs the {reporter} package, which is not "
                                          "installed"):
        parse(["--ds_config", DEBUG_CPU, "--report_to", reporter], 1)


def test_batch_sizes_are_checked_against_the_world_size(tmp_path):
    path = debug_cpu_config(tmp_path, train_batch_size=32)
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


@pytest.mark.gpu
def test_the_gpu_memory_cap_makes_larger_allocations_fail():

    from adaptive_ds.training.startup import cap_gpu_memory

    cap_gpu_memory(1.0)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
        torch.empty(2**29, dtype=torch.uint8, device="cuda")  # half a GiB still fits
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_a_named_variant_sets_its_architecture_and_fields_and_explicit_overrides_win(tmp_path):
    settings, _ = parse(["--ds_config", DEBUG_CPU, "--arch", "mod", "--variant", "mod:paper"], 1)
    assert settings.model == {"mod_capacity": 0.125, "mod_layer_interval": 2}  # Raposo et al.'s best setting
    settings, _ = parse(["--ds_config", DEBUG_CPU, "--variant", "mod:half", "--model", '{"mod_layer_interval": 2}'], 1)
    # the variant's arch, replacing the block's dense
    assert (settings.arch, settings.model) == ("mod", {"mod_capacity": 0.5, "mod_layer_interval": 2})
    settings, _ = parse(["--ds_config", debug_cpu_config(tmp_path, block={"arch": "moe", "variant": "moe:noaux"}),
                         "--controller", '{"spike_sigma": 3}'], 1)  # the block's variant, its controller setting too
    assert (settings.arch, settings.model) == ("moe", {"router_aux_loss_coef": 0.0})
    assert settings.controller == {"moe_balance": False, "spike_sigma": 3}
    settings, _ = parse(["--ds_config", DEBUG_CPU, "--variant", "hybrid"], 1)  # what the architecture ships with
    assert (settings.arch, settings.model) == ("hybrid", {})


def test_an_unknown_variant_or_one_of_another_arch_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", DEBUG_CPU, "--arch", "mod", "--variant", "mod:fast"], 1)
    assert str(error.value).startswith("unknown variant 'mod:fast'; valid choices: dense, moe, mod, hybrid, ")
    assert "mod:paper, mod:half" in str(error.value) and "\n" not in str(error.value)
    for arch in ("dense", "moe", "hybrid"):  # a MoD variant's fields on another architecture
        with pytest.raises(ConfigError, match=rf"^variant mod:half is a mod variant, and arch is {arch}; leave arch "
                                              rf"out \(the variant names it\) or pick a {arch} variant: {arch}(, |$)"):
            parse(["--ds_config", DEBUG_CPU, "--arch", arch, "--variant", "mod:half"], 1)
    with pytest.raises(ConfigError, match="^variant moe:top1 is a moe variant, and arch is dense;"):
        parse(["--ds_config", DEBUG_CPU, "--variant", "moe:top1", "--arch", "dense"], 1)  # an explicit dense too
    # the block's arch gives way to the flag (above), not to a variant beside it in the block
    with pytest.raises(ConfigError, match="^variant moe:top1 is a moe variant, and arch is dense;"):
        parse(["--ds_config", debug_cpu_config(tmp_path, block={"variant": "moe:top1"})], 1)


@pytest.mark.parametrize(("arch", "old", "new", "line"), [
    ("mod", "mod_half", ["--variant", "mod:half"],
     "--variant mod_half is deprecated and goes in 0.3; it is now spelt --variant mod:half"),
    ("mod", "mod_paper", ["--variant", "mod:paper"],
     "--variant mod_paper is deprecated and goes in 0.3; it is now spelt --variant mod:paper"),
    # on the hybrid's MoD blocks, the old spelling's fields (no hybrid variant is the hybrid's defaults at capacity 0.5)
    ("hybrid", "mod_half", ["--model", '{"mod_capacity": 0.5, "mod_layer_interval": 1}'],
     "--variant mod_half is deprecated and goes in 0.3; with arch hybrid it is --model "
     "'{\"mod_capacity\": 0.5, \"mod_layer_interval\": 1}'"),
])
def test_an_old_variant_spelling_means_what_it_meant_with_one_warning(arch, old, new, line, caplog):
    caplog.set_level("WARNING", logger="adaptive_ds")
    settings, _ = parse(["--ds_config", DEBUG_CPU, "--arch", arch, "--variant", old], 1)
    assert [r.getMessage() for r in caplog.records] == [line]
    caplog.clear()
    renamed, _ = parse(["--ds_config", DEBUG_CPU, "--arch", arch, *new], 1)
    assert not caplog.records
    built = [model_config(s.preset, s.arch, 128, **s.model) for s in (settings, renamed)]
    assert built[0].to_dict() == built[1].to_dict() and (settings.arch, settings.controller) == (arch, {})
    # what the old spelling named before the rename: capacity 0.5 in every block, or the paper's setting
    assert (built[0].mod_capacity, built[0].mod_layer_interval) == ((0.5, 1) if old == "mod_half" else (0.125, 2))
    with pytest.raises(ConfigError, match="^variant mod:[a-z]+ is a mod variant, and arch is dense;"):
        parse(["--ds_config", DEBUG_CPU, "--arch", "dense", "--variant", old], 1)  # refused, as it was


@pytest.mark.parametrize(("argv", "capacity", "interval"), [
    ([], 0.125, 2),  # mod's default: the paper's setting
    (["--variant", "mod:half"], 0.5, 1),  # the default before it
    (["--variant", "mod:half", "--model", '{"mod_layer_interval": 2}'], 0.5, 2),
])
def test_the_mod_model_a_run_builds(argv, capacity, interval):
    settings, _ = parse(["--ds_config", DEBUG_CPU, "--arch", "mod", *argv], 1)
    config = model_config(settings.preset, settings.arch, 128, **settings.model)  # as the training loop builds it
    assert (config.mod_capacity, config.mod_layer_interval) == (capacity, interval)


def _defaults(names) -> dict:
    """Each field at AdaptiveDSConfig's default: a value of the right type, valid for the architectures that read it."""
    return {name: AdaptiveDSConfig.__dataclass_fields__[name].default for name in names}


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([("mod", MOD_FIELDS, ("dense", "moe")), ("MoE", MOE_FIELDS, ("dense", "mod"))]).flatmap(
    lambda kind: st.tuples(st.just(kind[0]), st.lists(st.sampled_from(kind[1]), min_size=1, max_size=3, unique=True),
                           st.sampled_from(kind[2]))))
def test_a_model_field_of_an_architecture_the_run_has_not_is_refused_in_one_line(case):
    """Any MoD field with dense or moe, any MoE field with dense or mod: the line names the fields, the run's arch and
    the architectures that read them (before, dense trained on with its MoD fields ignored)."""
    kind, names, arch = case
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", DEBUG_CPU, "--arch", arch, "--model", json.dumps(_defaults(names))], 1)
    readers = "mod and hybrid (MoD routing)" if kind == "mod" else "moe and hybrid (experts)"
    assert str(error.value) == f"model field(s) {', '.join(names)} apply to arch {readers}, not to arch {arch}"


@pytest.mark.parametrize(("arch", "names"), [("mod", MOD_FIELDS), ("hybrid", MOD_FIELDS), ("moe", MOE_FIELDS),
                                             ("hybrid", MOE_FIELDS)])
def test_the_fields_of_an_architecture_are_taken_by_it(arch, names):
    settings, _ = parse(["--ds_config", DEBUG_CPU, "--arch", arch, "--model", json.dumps(_defaults(names))], 1)
    assert set(names) <= set(settings.model)


@pytest.mark.parametrize(("argv", "config_changes", "message"), [
    (["--arch", "dense", "--model", '{"mod_capacity": 2}'], {},
     "model field(s) mod_capacity apply to arch mod and hybrid (MoD routing), not to arch dense"),
    (["--arch", "mod", "--ep_size", "2"], {},
     "model field(s) moe_ep_size apply to arch moe and hybrid (experts), not to arch mod"),
    ([], {"block": {"model": {"num_experts_per_tok": 1, "mod_layer_interval": 2}}},
     "model field(s) num_experts_per_tok apply to arch moe and hybrid (experts), not to arch dense; model field(s) "
     "mod_layer_interval apply to arch mod and hybrid (MoD routing), not to arch dense"),
])
def test_the_docs_example_and_both_kinds_at_once(tmp_path, argv, config_changes, message):
    with pytest.raises(ConfigError) as error:
        parse(["--ds_config", debug_cpu_config(tmp_path, **config_changes), *argv], 1)
    assert str(error.value) == message


def test_the_settings_default_data_is_the_embedded_corpus():
    """arguments.py spells it (adaptive_ds.data imports torch, which the settings must not)."""
    assert RunSettings().data == data.EMBEDDED
