"""Architectures live in models/ (and their variants in presets.py): no other module of adaptive_ds branches on one
(the kinds of branch: tests/helpers/architecture_branches.py, which tests/unit/test_families.py uses too). The modules
ask the model, its configuration or its spec instead (adaptive_ds/models/spec.py)."""

from helpers.architecture_branches import architecture_branches
from helpers.common import ROOT

PACKAGE = ROOT / "adaptive_ds"
# A same-spelt literal about something else than an architecture, each with its reason: (module, the comparison).
NOT_ARCHITECTURES = {
    ("tools/benchmark.py", "name != 'dense'"): "a benchmark case named dense, the ratios' denominator",
    ("tools/grid_runs.py", "'mod' in m"): "the MoD section of a metrics record, present where the model routes",
    ("tools/grid_spec.py", "self.baseline != 'dense'"): "the grid's --baseline default, named in the command only "
                                                       "where another variant is the baseline",
}


def _checked_files():
    """Every module of the package but models/ and presets.py, and the temporary allow-list."""
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("models/") or relative == "presets.py":
            continue
        yield relative, path


def test_no_module_outside_models_and_presets_branches_on_an_architecture():
    checked = dict(_checked_files())
    # the trainer, its arguments, export and the planner are in the scope
    assert {"training/loop.py", "training/arguments.py", "export/final.py", "tools/plan.py"} <= set(checked)
    found = [(name, line, what, segment) for name, path in checked.items()
             for line, what, segment in architecture_branches(path.read_text())]
    branches = [f"{name}:{line}: {what}: {segment}" for name, line, what, segment in found
                if (name, segment) not in NOT_ARCHITECTURES]
    assert not branches, "architecture branches outside models/ and presets.py (ask the model or its spec):\n" + \
        "\n".join(branches)
    # each allowed literal is still there (an entry whose code went would allow its next use unseen)
    assert set(NOT_ARCHITECTURES) <= {(name, segment) for name, _, _, segment in found}


PLANTED = '''\
def f(config, settings, source, variant, name, case, kind):
    if config.arch == "moe":
        pass
    if settings.arch in ("mod", "hybrid"):
        pass
    if "dense" != source.arch:
        pass
    if config.uses_mod:
        pass
    return arch not in ["hybrid"], case.model["arch"] == "dense"
from ..presets import MOE_ARCHITECTURES
def g(config, settings, model, name, kind):
    if getattr(config, "uses_moe") or hasattr(model, "uses_mod"):
        pass
    if config.arch_spec.moe or ARCH_SPECS[name].mod or architecture_spec(settings.arch).moe:
        pass
    match config.arch:
        case "moe" | "hybrid":
            pass
    DEFAULTS = {"dense": 1, "mod": 2}
    steps = DEFAULTS[config.arch] + DEFAULTS.get(settings.arch, 0) + {"llama": 1}.get(kind)
    if name == "moe" or config.arch.startswith("mo") or "mixtral" == kind:
        pass
    return steps, architecture_spec(name).plain
'''

ALLOWED = '''\
def g(variant, settings, name, results, model_config, report, ds_config):
    if variant.arch != settings.arch:  # two user values: a consistency check
        pass
    if settings.arch == "bogus":  # not an architecture
        pass
    if report.moe is not None and name.startswith("run"):  # a report's section, not a spec; not an arch
        pass
    block = ds_config.get("adaptive_ds", {})  # a key, looked up by a constant
    return model_config("b1", "moe", 32000), {"arch": "mod"}, block, CASES[name]
CASES = {"dense": 1}
'''


def test_the_detector_finds_a_planted_branch_of_each_kind_and_nothing_else():
    assert [(line, what) for line, what, _ in architecture_branches(PLANTED)] == [
        (2, "compares with moe"), (4, "compares with hybrid, mod"), (6, "compares with dense"), (8, "uses_mod"),
        (10, "compares with dense"), (10, "compares with hybrid"), (11, "imports MOE_ARCHITECTURES"),
        (13, "names uses_mod"), (13, "names uses_moe"),
        (15, "asks a spec's mod"), (15, "asks a spec's moe"), (15, "asks a spec's moe"),
        (17, "matches hybrid, moe"),
        (21, "looks up DEFAULTS, keyed by names"), (21, "looks up DEFAULTS, keyed by names"),
        (21, "looks up a table keyed by names"),
        (22, "compares with mixtral"), (22, "compares with moe"), (22, "startswith"),
        (24, "asks a spec's plain")]
    assert architecture_branches(ALLOWED) == []
