"""The docstring shard builder, on a temporary installation written to tmp_path: read by the existing text reader,
deduplicated, deterministic, safe on sources that must not be imported, and refusing a bad --out."""

import gzip
import json
import textwrap

import pytest
from helpers.common import ROOT

from adaptive_ds.data.docstrings import build_shard, main
from adaptive_ds.data.text import open_documents

SHARED = "Return the sum of the two values, rounded to the nearest whole number."


def _install(root):
    """Two packages and a module; `alpha` and `beta` share one docstring (whitespace aside)."""
    files = {
        "alpha/__init__.py": '"""Alpha: a package for testing the docstring shard builder."""\n',
        "alpha/core.py": f'''
            class Adder:
                """Adds numbers together, as the tests need them added."""

                def add(self, a, b):
                    """{SHARED}"""

            if True:
                def conditional():
                    """A function defined inside an if statement, still documented."""
            ''',
        "beta/__init__.py": '''
            def add(a, b):
                """Return the sum of the two   values,
                rounded to the nearest whole number."""
            ''',
        # never imported: an import would exit, fail or hang
        "beta/effects.py": '''
            """A module whose import would end the process, which a reader by ast never runs."""
            raise SystemExit("imported")
            ''',
        "beta/hang.py": '"""A module whose import would never return, read all the same."""\nwhile True:\n    pass\n',
        "beta/py2.py": 'print "a Python 2 source that does not parse"\n',
        "beta/tests/test_beta.py": '"""A test suite\'s docstring, which the builder leaves out."""\n',
        "gamma.py": '"""Gamma: a top-level module of its own, with one docstring."""\n',
        "short.py": '"""Too short."""\n',
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (root / "beta" / "latin1.py").write_bytes(b'"""caf\xe9: not UTF-8."""\n')
    (root / "beta" / "gone.py").symlink_to(root / "nowhere.py")  # a broken link


def _rows(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_docstrings_are_written_once_in_c4_format_and_read_by_the_text_reader(tmp_path):
    root, out = tmp_path / "site", tmp_path / "c4-train.00000-of-00001.json.gz"
    _install(root)
    build = build_shard(str(out), [str(root)], max_mb=1)
    rows = _rows(out)
    assert all(set(row) == {"text", "timestamp", "url"} for row in rows)
    urls = [row["url"] for row in rows]
    # beta's __init__ comes before alpha's core (the packages take turns by file): its copy is the one kept
    assert "pydoc://beta/beta.add" in urls and "pydoc://alpha/alpha.core.Adder.add" not in urls
    assert {"pydoc://alpha/alpha", "pydoc://alpha/alpha.core.Adder", "pydoc://alpha/alpha.core.conditional",
            "pydoc://beta/beta.effects", "pydoc://beta/beta.hang", "pydoc://gamma/gamma"} <= set(urls)
    assert len(urls) == len(set(urls)) == 7 and build.documents == 7 and build.duplicates == 1
    # py2.py, latin1.py, gone.py; the test suite and the short docstring are left out without a count
    assert build.skipped == {"not_parsable": 1, "not_utf8": 1, "unreadable": 1}
    texts = list(open_documents(str(out)))  # the reader training and prepare use
    assert texts == [row["text"] for row in rows] and [" ".join(t.split()) for t in texts].count(SHARED) == 1
    assert [u.split("/")[2] for u in urls][:3] == ["alpha", "beta", "gamma"]  # then alpha's next file


def test_the_shard_is_deterministic_and_capped(tmp_path):
    root = tmp_path / "site"
    _install(root)
    a, b, small = (str(tmp_path / f"{name}.json.gz") for name in ("a", "b", "small"))
    build_shard(a, [str(root)], max_mb=1)
    build_shard(b, [str(root)], max_mb=1)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    first_two = sum(len(json.dumps(row, ensure_ascii=False)) + 1 for row in _rows(a)[:2])
    capped = build_shard(small, [str(root)], max_mb=(first_two + 5) / 1e6)
    assert _rows(small) == _rows(a)[:2] and capped.bytes == first_two


def test_a_bad_out_is_one_clear_error_and_destroys_nothing(tmp_path, capsys):
    root = tmp_path / "site"
    _install(root)
    with pytest.raises(SystemExit, match="--out directory .*no_such_dir' does not exist; create it first"):
        main(["--out", str(tmp_path / "no_such_dir" / "shard.json.gz"), "--roots", str(root)])
    with pytest.raises(SystemExit, match="must end with .json.gz or .jsonl.gz"):
        main(["--out", str(tmp_path / "shard.txt"), "--roots", str(root)])
    existing = tmp_path / "mine.json.gz"
    existing.write_bytes(b"precious")
    with pytest.raises(SystemExit, match="already exists"):
        main(["--out", str(existing), "--roots", str(root)])
    assert existing.read_bytes() == b"precious" and not list(tmp_path.glob("*.partial"))


def test_the_published_text_grids_name_a_corpus_the_repository_rebuilds(tmp_path, monkeypatch):
    """BENCHMARKS.md's docstring-text grids record how their corpus was made: the builder's --out, prepare's --data
    and --out, and the grids' --data chain up, all relative to the repository's root; the recorded --out builds a
    shard there (here on a small installation)."""
    import os
    import re
    import shlex

    from adaptive_ds.tools.grid_spec import GridSpec

    text = " ".join((ROOT / "BENCHMARKS.md").read_text().split())
    build = shlex.split(re.search(r"python -m adaptive_ds\.data\.docstrings ([^`]*)`", text).group(1))
    prepare = shlex.split(re.search(r"python -m adaptive_ds\.data\.prepare ([^`]*)`", text).group(1))
    shard, prepared = build[build.index("--out") + 1], prepare[prepare.index("--out") + 1]
    assert not os.path.isabs(shard) and not os.path.isabs(prepared)
    assert prepare[prepare.index("--data") + 1] == os.path.dirname(shard)
    grids = [json.loads(p.read_text()) for p in sorted((ROOT / "benchmarks").glob("grid_debug_text-prepared*.json"))]
    assert grids and {g["data"] for g in grids} == {prepared}
    assert all(f"--data {prepared} " in g["command"] for g in grids)
    assert GridSpec("debug", (), (1,), 1, "x", data=prepared).data_name == "text-prepared"
    root = tmp_path / "site"
    _install(root)
    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.dirname(shard))
    main([*build, "--roots", str(root)])
    assert [row["text"] for row in _rows(tmp_path / shard)][0].startswith("Alpha")
