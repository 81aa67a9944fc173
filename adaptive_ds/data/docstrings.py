"""Real text that every machine has offline: the docstrings of the installed Python packages, as a C4 shard.

    python -m adaptive_ds.data.docstrings --out data/docstrings/c4-train.00000-of-00001.json.gz [--max_mb 8]

Walks the standard library and site-packages (or `--roots`), reads every `.py` file with `ast` (nothing is
imported, so no import errors, side effects or hangs), and writes one JSON line per docstring of a module, class or
function: `{"text", "timestamp", "url"}` as in C4's `c4-train.*.json.gz`, the url `pydoc://PACKAGE/MODULE.QUALNAME`
and the timestamp the source file's modification time. Texts are deduplicated by a hash of their whitespace-
normalised form (the first occurrence is kept). The top-level packages take turns, one source file each, so a shard
capped by `--max_mb` (MB of JSON lines before compression) samples every package, not the first ones by name. The
order is deterministic (roots, packages and files sorted by name, docstrings in source order), and so is the file
(gzip without a name or time in its header): the same installation gives the same bytes.

Train on it as on any local C4 shard (`--data PATH --tokenizer bpe:8192`) or prepare it first
(`python -m adaptive_ds.data.prepare --data PATH`).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import gzip
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "testing"}
MAX_FILE_BYTES = 2_000_000  # larger sources are generated tables, not documentation; and slow to parse
OUT_ENDINGS = (".json.gz", ".jsonl.gz")


def default_roots() -> list[str]:
    """The standard library and the site-packages of this interpreter (each once)."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        path = os.path.realpath(paths[key])
        if os.path.isdir(path) and path not in roots:
            roots.append(path)
    return roots


def packages(root: str) -> list[tuple[str, Iterator[tuple[str, str]]]]:
    """The top-level packages and modules in `root`, sorted by name: (name, its (module name, path) files, lazily).
    Folders that are not importable names (`*.dist-info`), caches and test suites are skipped."""
    found = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.isdir(path) and name.isidentifier() and name not in SKIP_DIRS:
            found.append((name, _package_files(path, name)))
        elif name.endswith(".py") and name[:-3].isidentifier() and os.path.isfile(path):
            found.append((name[:-3], iter([(name[:-3], path)])))
    return found


def _package_files(directory: str, package: str) -> Iterator[tuple[str, str]]:
    """(module name, path) of the `.py` files in a package folder, folders and files sorted by name."""
    for folder, subfolders, files in os.walk(directory):
        subfolders[:] = sorted(d for d in subfolders if d.isidentifier() and d not in SKIP_DIRS)
        relative = os.path.relpath(folder, directory)
        prefix = [package] if relative == "." else [package, *relative.split(os.sep)]
        for name in sorted(files):
            stem = name[:-3]
            if name.endswith(".py") and stem.isidentifier() and not stem.startswith("test_"):
                yield ".".join(prefix if stem == "__init__" else [*prefix, stem]), os.path.join(folder, name)


def docstrings(source: str, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name, cleaned docstring) of the module and every class and function in it, in source order.
    Definitions inside `if`, `try` and the like count as the module's (or the class's)."""
    yield from _definitions(ast.parse(source), module)


def _definitions(node: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
    doc = ast.get_docstring(node, clean=True) if isinstance(node, _DOCUMENTED) else None
    if doc and doc.strip():
        yield qualname, doc.strip()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _definitions(child, f"{qualname}.{child.name}")
        elif isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
            yield from _definitions(child, qualname)


_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def normalized(text: str) -> str:
    """The form two texts are compared in: whitespace runs collapsed."""
    return " ".join(text.split())


@dataclass
class Build:
    """What a build wrote and skipped."""

    documents: int = 0
    bytes: int = 0  # of JSON lines, before compression
    duplicates: int = 0
    skipped: Counter = field(default_factory=Counter)  # files, by reason
    packages: set[str] = field(default_factory=set)  # top-level packages with a docstring in the shard


def _read(path: str, skipped: Counter) -> tuple[str, float] | None:
    """The file's source and modification time, or None (counted by reason) if it cannot be read or is too large."""
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            return None
        with open(path, encoding="utf-8") as f:
            return f.read(), os.path.getmtime(path)
    except UnicodeDecodeError:
        skipped["not_utf8"] += 1
    except OSError:  # unreadable, or a broken link
        skipped["unreadable"] += 1
    return None


def _file_records(package: str, module: str, path: str, min_chars: int, skipped: Counter) -> list[dict]:
    read = _read(path, skipped)
    if read is None:
        return []
    source, mtime = read
    timestamp = datetime.datetime.fromtimestamp(int(mtime), datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        found = list(docstrings(source, module))
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # Python 2 sources, null bytes, deep nesting
        skipped["not_parsable"] += 1
        return []
    return [{"text": text, "timestamp": timestamp, "url": f"pydoc://{package}/{qualname}"}
            for qualname, text in found if len(text) >= min_chars]


def records(roots: list[str], min_chars: int, build: Build) -> Iterator[dict]:
    """C4 records of the docstrings under `roots`, deduplicated. The top-level packages take turns, one source file
    each, so that a capped shard samples every package rather than the first ones by name."""
    seen: set[bytes] = set()
    streams = [_package_records(name, files, min_chars, build.skipped) for root in roots
               for name, files in packages(root)]
    for record in _round_robin(streams):
        key = hashlib.blake2b(normalized(record["text"]).encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in seen:
            build.duplicates += 1
        else:
            seen.add(key)
            yield record


def _package_records(package: str, files: Iterator[tuple[str, str]], min_chars: int,
                     skipped: Counter) -> Iterator[list[dict]]:
    """One list of records per source file of `package`."""
    for module, path in files:
        yield _file_records(package, module, path, min_chars, skipped)


def _round_robin(streams: list[Iterator[list[dict]]]) -> Iterator[dict]:
    """The items of each stream's next list, stream after stream, until every stream is exhausted."""
    while streams:
        active = []
        for stream in streams:
            chunk = next(stream, None)
            if chunk is not None:
                yield from chunk
                active.append(stream)
        streams = active


def out_problems(out: str) -> list[str]:
    """What is wrong with an --out path (empty if nothing)."""
    directory = os.path.dirname(os.path.abspath(out))
    if not out.endswith(OUT_ENDINGS):
        return [f"--out {out!r} must end with {' or '.join(OUT_ENDINGS)} (a C4 shard the data readers recognise)"]
    if not os.path.isdir(directory):
        return [f"--out directory {directory!r} does not exist; create it first"]
    if os.path.exists(out):
        return [f"--out {out!r} already exists; remove it or choose another path"]
    return []


def build_shard(out: str, roots: list[str], max_mb: float, min_chars: int = 40) -> Build:
    """Write the shard to `out` and return what was written. It is written to `out.partial` and renamed when
    complete, so `out` is never half a shard."""
    problems = out_problems(out) + [f"--roots {r!r} is not a directory" for r in roots if not os.path.isdir(r)]
    if problems:
        raise ValueError(problems[0])
    build, limit, partial = Build(), int(max_mb * 1e6), f"{out}.partial"
    try:
        with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            for record in records(roots, min_chars, build):
                line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "surrogatepass")
                if build.bytes + len(line) > limit:
                    break
                f.write(line)
                build.documents += 1
                build.bytes += len(line)
                build.packages.add(record["url"].split("/")[2])
    except BaseException:
        os.remove(partial)
        raise
    os.replace(partial, out)
    return build


def check(args: argparse.Namespace) -> None:
    """What main checks before it walks a folder: --out and --roots (`build_shard` checks them again); ValueError in
    one line."""
    problems = out_problems(args.out) + [f"--roots {r!r} is not a directory" for r in args.roots or []
                                         if not os.path.isdir(r)]
    if problems:
        raise ValueError(problems[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the shard to write, e.g. "
                        "data/docstrings/c4-train.00000-of-00001.json.gz (its folder must exist)")
    parser.add_argument("--max_mb", type=float, default=8.0, help="MB of JSON lines (before compression) at most")
    parser.add_argument("--min_chars", type=int, default=40, help="shorter docstrings are left out")
    parser.add_argument("--roots", nargs="+", help="folders to walk (default: the standard library and "
                                                   "site-packages)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    roots = args.roots or default_roots()
    start = time.perf_counter()
    try:
        check(args)
        build = build_shard(args.out, roots, args.max_mb, args.min_chars)
    except ValueError as e:
        sys.exit(f"error: {e}")
    logger.info("wrote %s: %d docstrings from %d packages, %.1f MB of JSON lines (%.1f MB compressed) in %.0f s; "
                "%d duplicates left out; files skipped: %s", args.out, build.documents, len(build.packages),
                build.bytes / 1e6, os.path.getsize(args.out) / 1e6, time.perf_counter() - start, build.duplicates,
                dict(build.skipped) or "none")


if __name__ == "__main__":
    main()
