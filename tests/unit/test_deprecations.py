"""The deprecated module paths: each warns (DeprecationWarning) and still does what it did, and each has its removal
version in CHANGELOG.md, under the heading of the version that deprecates it, which is the package's version."""

import contextlib
import importlib
import io
import re
import runpy
import sys

import pytest
from helpers.common import ROOT
from helpers.deprecated import MODULE_ALIASES, TOOL_ALIASES

import adaptive_ds

CHANGELOG = (ROOT / "CHANGELOG.md").read_text()


def _help(module: str, run) -> str:
    """What `python -m MODULE --help` prints, run in this process by `run`."""
    out, saved = io.StringIO(), sys.argv
    sys.argv = [f"{module}.py", "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
            run()
    finally:
        sys.argv = saved
    assert exited.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize(("alias", "tool"), TOOL_ALIASES.items())
def test_an_old_command_path_warns_and_runs_its_tool(alias, tool):
    with pytest.warns(DeprecationWarning, match=rf"python -m {re.escape(alias)} is deprecated and goes in 0\.3: "
                                                rf"run python -m {re.escape(tool)}$"):
        through_alias = _help(alias, lambda: runpy.run_module(alias, run_name="__main__"))
    direct = _help(alias, lambda: importlib.import_module(tool).main())
    assert through_alias == direct and "usage:" in direct  # the tool's own parser answered


def test_the_old_consolidate_module_warns_and_is_the_checkpoint_packages():
    from adaptive_ds.training.checkpoint import consolidate

    sys.modules.pop("adaptive_ds.training.consolidate", None)
    deprecated = "adaptive_ds.training.consolidate is deprecated and goes in 0.3"
    with pytest.warns(DeprecationWarning, match=deprecated) as caught:
        from adaptive_ds.training.consolidate import main, script_text  # what the earlier scripts import
    # attributed to the importing code, so that an earlier checkpoint's script, run as __main__, shows it
    assert [w.filename for w in caught] == [__file__]
    assert (main, script_text) == (consolidate.main, consolidate.script_text)
    # the scripts that checkpoints get now import the module itself, so they keep working after the alias goes
    assert "from adaptive_ds.training.checkpoint import consolidate" in consolidate.script_text("zero_to_fp32.py")


def _versioned_sections() -> dict[str, str]:
    """CHANGELOG.md's `## X.Y.Z` sections, by version, newest first; an `## Unreleased` section (what main holds
    beyond the version, as Keep a Changelog has it) may precede them only, and is not a version."""
    parts = re.split(r"^## (\S+)\n", CHANGELOG, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert "Unreleased" not in list(sections)[1:], "## Unreleased comes first, above the versions"
    sections.pop("Unreleased", None)
    return sections


def test_the_version_is_the_metadatas_and_heads_the_changelog():
    from setuptools.config.setupcfg import read_configuration

    # the version a build of this tree records as the distribution's metadata (setup.cfg reads it from the package)
    assert read_configuration(str(ROOT / "setup.cfg"))["metadata"]["version"] == adaptive_ds.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", adaptive_ds.__version__)
    assert next(iter(_versioned_sections())) == adaptive_ds.__version__


def test_every_deprecated_path_has_its_removal_version_in_the_changelog():
    major, minor, _ = adaptive_ds.__version__.split(".")
    section = _versioned_sections()[adaptive_ds.__version__]
    deprecated = section.split("### Deprecated")[1].split("\n### ")[0]
    assert f"deprecated in {major}.{minor}, removed in {major}.{int(minor) + 1}" in deprecated
    for name in [*TOOL_ALIASES, *MODULE_ALIASES, "RENAMED_VARIANTS"]:
        assert f"`{name}`" in deprecated or f"python -m {name}`" in deprecated, name
    # and each module says so itself, so that a reader of the source finds its removal
    for name in [*TOOL_ALIASES, *MODULE_ALIASES]:
        source = (ROOT / (name.replace(".", "/") + ".py")).read_text()
        assert f"Deprecated in {major}.{minor}, removed in {major}.{int(minor) + 1}" in " ".join(source.split()), name
