"""The data pipeline's throughput and resume time, beside the tokens/s the shipped GPU configs need.

    python -m adaptive_ds.data.benchmark --work /tmp/data_bench --write BENCHMARKS.md

Builds a local C4-format corpus (gzipped JSON lines of {"text", "timestamp", "url"}, from the docstrings of the
Python modules installed here: text available offline), trains a 32k byte-level BPE on it, then measures:
preparing it (`adaptive_ds.data.prepare`, every core); streaming it with 0, 1 and 2 DataLoader workers; reading
prepared shards (a B1 step: 8 rows of 2048 tokens); and the time to the first batch when resuming shallow and
deep, for prepared and streamed data. Beside them: each shipped GPU config's projected tokens/s
(`adaptive_ds.plan`), so the headroom is in one table.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import logging
import os
import platform
import subprocess
import sys
import time

from ..plan import SCENARIOS, plan_config
from ..presets import PRESETS
from . import build_training_data
from .prepare import PrepareArguments, prepare
from .streaming import StreamingData

logger = logging.getLogger(__name__)

SEQ_LEN = PRESETS["b1"].seq_len
ROWS = 8  # rows per step in the measurements


def docstrings(limit_chars: float) -> list[str]:
    """Docstrings of modules, classes and functions under the interpreter's library directories (standard library
    first), until `limit_chars` characters."""
    roots = [os.path.dirname(os.__file__)] + sorted(p for p in sys.path if p.endswith("site-packages"))
    texts = []
    for root in roots:
        for folder, _, files in sorted(os.walk(root)):
            for name in sorted(f for f in files if f.endswith(".py")):
                try:
                    tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
                except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                    continue  # not parseable by this interpreter: not text we need
                for node in ast.walk(tree):
                    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                        doc = ast.get_docstring(node)
                        if doc and len(doc) > 200:
                            texts.append(doc)
                            limit_chars -= len(doc)
                if limit_chars <= 0:
                    return texts
    return texts


def write_corpus(directory: str, files: int, target_mb: float) -> list[str]:
    """C4-format shards c4-train.0000N-of-0000M.json.gz holding `target_mb` MB of text in all (repeated)."""
    os.makedirs(directory, exist_ok=True)
    texts, paths, written, index = docstrings(min(target_mb, 4.0) * 1e6), [], 0, 0  # repeated up to the target
    per_file = target_mb * 1e6 / files
    for n in range(files):
        path = os.path.join(directory, f"c4-train.{n:05d}-of-{files:05d}.json.gz")
        size = 0
        with gzip.open(path, "wt") as f:
            while size < per_file:
                text = texts[index % len(texts)]
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                                    "url": f"https://docs.example/{index}"}) + "\n")
                size += len(text)
                index += 1
        written += size
        paths.append(path)
    logger.info("corpus: %d documents, %.1f MB of text in %d files", index, written / 1e6, files)
    return paths


def _first_and_rate(batches, steps: int) -> tuple[float, float]:
    """(seconds to the first batch, tokens/s over `steps` steps from the start, start-up included)."""
    started = time.perf_counter()
    next(batches)
    first = time.perf_counter() - started
    for _ in range(steps - 1):
        next(batches)
    return first, steps * ROWS * SEQ_LEN / (time.perf_counter() - started)


def measure(work: str, steps: int) -> dict:
    corpus = os.path.join(work, "c4")
    paths = [os.path.join(corpus, f) for f in sorted(os.listdir(corpus))]
    prepared_dir = os.path.join(work, "prepared")
    manifest = prepare(PrepareArguments(corpus, "bpe:32768", SEQ_LEN, tokenizer_sample_docs=20000), prepared_dir)
    total = manifest["train"]["tokens"] + manifest["validation"]["tokens"]
    results = {"corpus_files": len(paths), "corpus_tokens": total, "vocab_size": manifest["vocab_size"],
               "prepare_tokens_per_s": total / manifest["seconds"], "prepare_seconds": manifest["seconds"]}
    data = build_training_data(prepared_dir, SEQ_LEN, seed=0, workers=2)
    tokenizer = data.tokenizer
    for workers in (0, 2):
        data.workers = workers
        results[f"prepared_{workers}_workers"] = _first_and_rate(data.step_batches(0, ROWS), steps)
    for depth in (10, 1_000_000):  # a million steps: 16B tokens, dozens of epochs of this corpus
        results[f"prepared_resume_{depth}"] = _first_and_rate(data.step_batches(depth, ROWS), 1)[0]
    for workers in (0, 1, 2):
        stream = StreamingData(corpus, tokenizer, SEQ_LEN, 0, "text", None, 0.01, workers=workers)
        results[f"streaming_{workers}_workers"] = _first_and_rate(stream.step_batches(0, ROWS), steps)
    results.update(_streaming_resume(corpus, tokenizer, steps))
    return results


def _streaming_resume(corpus: str, tokenizer, steps: int) -> dict:
    """Time to the first batch after loading a position saved early and one saved deep in the stream."""
    stream = StreamingData(corpus, tokenizer, SEQ_LEN, 0, "text", None, 0.01, workers=0)
    batches = stream.step_batches(0, ROWS)
    positions = {}
    for step in range(1, 4 * steps + 1):
        next(batches)
        if step in (10, 4 * steps):
            positions[step] = json.loads(json.dumps(stream.state_dict()))
    times = {}
    for step, state in positions.items():
        resumed = StreamingData(corpus, tokenizer, SEQ_LEN, 0, "text", None, 0.01, workers=0)
        resumed.load_state_dict(state)
        started = time.perf_counter()
        next(resumed.step_batches(step, ROWS))
        times[f"streaming_resume_{step}"] = time.perf_counter() - started
    return times


def gpu_needs() -> list[tuple[str, str, str, float]]:
    """(preset, arch, config, projected tokens/s) of every shipped GPU config."""
    rows = []
    for preset, archs, gpu, config in SCENARIOS:
        for arch in archs:
            p = plan_config(preset, arch, gpu, os.path.join("ds_configs", config))
            rows.append((preset, arch, f"{p.gpus} x {gpu}, `{config}`", p.tokens_per_s_projected))
    return rows


def markdown(r: dict, command: str) -> str:
    needs = gpu_needs()
    fastest = max(needs, key=lambda n: n[3])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rate = r["prepared_2_workers"][1]
    lines = [
        f"Measured by `{command}` at commit {commit} on {os.cpu_count()} CPU cores ({platform.processor() or 'x86_64'}"
        f", shared with other jobs): a local C4-format corpus ({r['corpus_files']} `.json.gz` files, "
        f"{r['corpus_tokens']:,} tokens of Python docstrings), a byte-level BPE of {r['vocab_size']:,} tokens, "
        f"steps of {ROWS} x {SEQ_LEN} tokens (B1's sequence length).", "",
        "| pipeline | tokens/s | first batch | resume at step 10 | resume deep |", "|---|---|---|---|---|",
        f"| prepare (tokenize once, {os.cpu_count()} worker processes) | {r['prepare_tokens_per_s']:,.0f} | | | |",
    ]
    for workers in (0, 1, 2):
        first, tps = r[f"streaming_{workers}_workers"]
        resume = (f"{r['streaming_resume_10']:.2f} s", f"{r[max(k for k in r if k.startswith('streaming_resume'))]:.2f}"
                  f" s (step {max(int(k.rsplit('_', 1)[1]) for k in r if k.startswith('streaming_resume'))})")
        lines.append(f"| streaming, {workers} workers | {tps:,.0f} | {first:.2f} s | "
                     f"{resume[0] if workers == 0 else ''} | {resume[1] if workers == 0 else ''} |")
    for workers in (0, 2):
        first, tps = r[f"prepared_{workers}_workers"]
        deep = (f"{r['prepared_resume_10']:.3f} s", f"{r['prepared_resume_1000000']:.3f} s (step 1,000,000)")
        lines.append(f"| prepared shards, {workers} workers | {tps:,.0f} | {first:.3f} s | "
                     f"{deep[0] if workers == 2 else ''} | {deep[1] if workers == 2 else ''} |")
    lines += ["", "What the shipped GPU configs consume (planner projection, 35% MFU, not measured), against the "
              "prepared path's measured rate on these 2 cores:", "",
              "| preset | arch | hardware, config | projected tokens/s | headroom of prepared data |",
              "|---|---|---|---|---|"]
    for preset, arch, config, tps in needs:
        lines.append(f"| {preset} | {arch} | {config} | {tps:,.0f} | {rate / tps:,.0f}x |")
    lines += ["", f"The fastest config ({fastest[0]} {fastest[1]}, {fastest[2]}) needs {fastest[3]:,.0f} tokens/s; "
              f"prepared shards deliver {rate / fastest[3]:,.0f}x that on 2 cores."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Measure the data pipeline's tokens/s and resume time.")
    p.add_argument("--work", required=True, help="directory for the corpus and the prepared shards")
    p.add_argument("--corpus_mb", type=float, default=40.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="steps timed per pipeline")
    p.add_argument("--write", metavar="BENCHMARKS_MD", help="put the table in this Markdown file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not os.path.isdir(os.path.join(args.work, "c4")):
        write_corpus(os.path.join(args.work, "c4.partial"), args.files, args.corpus_mb)
        os.rename(os.path.join(args.work, "c4.partial"), os.path.join(args.work, "c4"))
    results = measure(args.work, args.steps)
    with open(os.path.join(args.work, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    text = markdown(results, "python -m adaptive_ds.data.benchmark " + " ".join(argv or sys.argv[1:]))
    print(text)
    if args.write:
        from ..report import replace_section

        replace_section(args.write, "data:benchmark", text, "Data pipeline (measured)")


if __name__ == "__main__":
    main()
