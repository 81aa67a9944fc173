"""The data pipeline's throughput and resume time, beside the tokens/s the shipped GPU configs need.

    python -m adaptive_ds.tools.data_benchmark [--corpus_mb 16] [--steps 200]

Builds a local C4-format corpus under --work (gzipped JSON lines of {"text", "timestamp", "url"}, from the
docstrings of the installed Python packages, `adaptive_ds.data.docstrings`: text available offline), trains a 32k
byte-level BPE on it, then measures: preparing it (`adaptive_ds.data.prepare`, every core); streaming it with 0, 1
and 2 DataLoader workers; reading prepared shards (a B1 step: 8 rows of 2048 tokens); and the time to the first
batch when resuming shallow and deep, for prepared and streamed data. Beside them: each shipped GPU config's
projected tokens/s (`adaptive_ds.tools.plan`, computed when the benchmark runs), so the headroom is in one table.

--work keeps what the command made there, each with its record: c4/ (corpus.json: its settings, reused when they
are this run's) and prepared/ (prepared.json: its manifest's hash; prepared afresh on every run). A c4/ without its
record, or a prepared/ the command did not make, ends it in one line before anything is computed or written.

It writes the JSON report `data_benchmark.json` into --out (default: the --work folder, `runs/data_benchmark`) and
prints the table; the table goes into a Markdown file as the section ``<!-- data:benchmark -->`` only when
--benchmarks_md names one, rendered from the report alone. Nothing a user runs writes into the repository's
committed results unless asked: publishing is `--out benchmarks --benchmarks_md BENCHMARKS.md`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import shutil
import sys
import time

from ..data import build_training_data
from ..data.docstrings import Build, default_roots, records
from ..data.prepare import PrepareArguments, prepare
from ..data.streaming import StreamingData
from ..ds_config import SHIPPED_DIR
from ..markdown_sections import replace_section
from ..presets import PRESETS
from .plan import SCENARIOS, plan_config
from .report import add_publish_arguments, check_markdown_path, commit, machine, write_report

logger = logging.getLogger(__name__)

SEQ_LEN = PRESETS["b1"].seq_len
ROWS = 8  # rows per step in the measurements
KEY = "data:benchmark"
DEEP_STEP = 1_000_000  # a prepared resume this deep: 16B tokens, dozens of epochs of the corpus
CORPUS_RECORD = "corpus.json"  # in --work: the settings of the corpus in c4/
PREPARED_RECORD = "prepared.json"  # in --work: the manifest of the prepare this command made in prepared/


def write_corpus(directory: str, files: int, target_mb: float) -> list[str]:
    """C4-format shards c4-train.0000N-of-0000M.json.gz holding `target_mb` MB of text in all: the installed
    packages' docstrings (at most 4 MB of them, repeated up to the target)."""
    os.makedirs(directory, exist_ok=True)
    texts, size = [], 0
    for record in records(default_roots(), 200, Build()):
        texts.append(record["text"])
        size += len(record["text"])
        if size >= min(target_mb, 4.0) * 1e6:
            break
    paths, written, index = [], 0, 0
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


def _first_and_rate(batches, steps: int) -> dict[str, float]:
    """Seconds to the first batch, and tokens/s over `steps` steps from the start (start-up included)."""
    started = time.perf_counter()
    next(batches)
    first = time.perf_counter() - started
    for _ in range(steps - 1):
        next(batches)
    return {"first_batch_s": first, "tokens_per_s": steps * ROWS * SEQ_LEN / (time.perf_counter() - started)}


def _manifest_sha256(prepared_dir: str) -> str | None:
    try:
        with open(os.path.join(prepared_dir, "manifest.json"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _record_prepared(work: str, prepared_dir: str) -> None:
    """Mark `prepared_dir` as this command's: its manifest's hash (None while the prepare runs)."""
    with open(os.path.join(work, PREPARED_RECORD), "w") as f:
        json.dump({"manifest_sha256": _manifest_sha256(prepared_dir)}, f)


def _prepared_problem(work: str) -> str | None:
    """Why `work`/prepared may not be prepared afresh (None when it is absent, empty, or what this command made
    there: the prepare its record names, or its partial prepare, killed before the manifest)."""
    prepared_dir = os.path.join(work, "prepared")
    if not os.path.lexists(prepared_dir) or (os.path.isdir(prepared_dir) and not os.listdir(prepared_dir)):
        return None
    try:
        with open(os.path.join(work, PREPARED_RECORD)) as f:
            made = json.load(f)["manifest_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        made = False  # no record of its own: never the command's
    if os.path.isdir(prepared_dir) and made == _manifest_sha256(prepared_dir):
        return None
    return (f"error: --work {work} holds prepared/ that this command did not make (it prepares afresh there); "
            "pass another --work, or move that folder")


def measure(work: str, steps: int) -> dict:
    """Every measurement on the corpus in `work`/c4 (prepared afresh into `work`/prepared, which only this command
    writes: one it did not make is refused)."""
    corpus = os.path.join(work, "c4")
    paths = [os.path.join(corpus, f) for f in sorted(os.listdir(corpus))]
    prepared_dir = os.path.join(work, "prepared")
    problem = _prepared_problem(work)
    if problem:
        raise SystemExit(problem)
    if os.path.isdir(prepared_dir):
        shutil.rmtree(prepared_dir)
    _record_prepared(work, prepared_dir)
    manifest = prepare(PrepareArguments(corpus, "bpe:32768", SEQ_LEN, tokenizer_sample_docs=20000), prepared_dir)
    _record_prepared(work, prepared_dir)
    total = manifest["train"]["tokens"] + manifest["validation"]["tokens"]
    results = {"prepare": {"tokens_per_s": total / manifest["seconds"], "seconds": manifest["seconds"],
                           "workers": os.cpu_count()}}
    data = build_training_data(prepared_dir, SEQ_LEN, seed=0, workers=2)
    tokenizer = data.tokenizer
    for workers in (0, 2):
        data.workers = workers
        results[f"prepared_{workers}_workers"] = _first_and_rate(data.step_batches(0, ROWS), steps)
    shallow = min(10, steps)
    results["prepared_resume_s"] = {str(depth): _first_and_rate(data.step_batches(depth, ROWS), 1)["first_batch_s"]
                                    for depth in (shallow, DEEP_STEP)}
    for workers in (0, 1, 2):
        stream = StreamingData(corpus, tokenizer, SEQ_LEN, 0, "text", None, 0.01, workers=workers)
        results[f"streaming_{workers}_workers"] = _first_and_rate(stream.step_batches(0, ROWS), steps)
    results["streaming_resume_s"] = _streaming_resume(corpus, tokenizer, (shallow, 4 * steps))
    return {"corpus_files": len(paths), "corpus_tokens": total, "vocab_size": manifest["vocab_size"],
            "results": results}


def _streaming_resume(corpus: str, tokenizer, at: tuple[int, int]) -> dict[str, float]:
    """Seconds to the first batch after loading a position saved early and one saved deep in the stream."""
    stream = StreamingData(corpus, tokenizer, SEQ_LEN, 0, "text", None, 0.01, workers=0)
    batches = stream.step_batches(0, ROWS)
    positions = {}
    for step in range(1, max(at) + 1):
        next(batches)
        if step in at:
            positions[step] = json.loads(json.dumps(stream.state_dict()))
    times = {}
    for step, state in positions.items():
        resumed = StreamingData(corpus, tokenizer, SEQ_LEN, 0, "text", None, 0.01, workers=0)
        resumed.load_state_dict(state)
        started = time.perf_counter()
        next(resumed.step_batches(step, ROWS))
        times[str(step)] = time.perf_counter() - started
    return times


def gpu_needs(config_dir: str = SHIPPED_DIR) -> list[dict]:
    """The planner's projected tokens/s of every shipped GPU config (`adaptive_ds.tools.plan.SCENARIOS`)."""
    needs = []
    for preset, archs, gpu, config in SCENARIOS:
        for arch in archs:
            p = plan_config(preset, arch, gpu, os.path.join(config_dir, config))
            needs.append({"preset": preset, "arch": arch, "gpus": p.gpus, "gpu": gpu, "config": config,
                          "mfu": p.mfu, "projected_tokens_per_s": p.tokens_per_s_projected})
    return needs


def _resume_cells(resume: dict[str, float], spec: str) -> tuple[str, str]:
    (shallow, early), (deep, late) = sorted(resume.items(), key=lambda item: int(item[0]))
    return f"{early:{spec}} s (step {int(shallow):,})", f"{late:{spec}} s (step {int(deep):,})"


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a report: provenance, the pipelines, and the headroom over each GPU config's
    projected need."""
    r = report["results"]
    rate = r["prepared_2_workers"]["tokens_per_s"]
    lines = [
        f"Measured {report['date']} on {report['machine']}, commit {report['commit']}: "
        f"`{report['command']}`. A local C4-format corpus ({report['corpus_files']} `.json.gz` files, "
        f"{report['corpus_tokens']:,} tokens of Python docstrings), a byte-level BPE of {report['vocab_size']:,} "
        f"tokens, steps of {report['rows']} x {report['seq_len']} tokens (B1's sequence length); tokens/s from the "
        "start, the first batch included.", "",
        "| pipeline | tokens/s | first batch | resume early | resume deep |", "|---|---|---|---|---|",
        f"| prepare (tokenize once, {r['prepare']['workers']} worker processes) | "
        f"{r['prepare']['tokens_per_s']:,.0f} | - | - | - |",
    ]
    streamed = _resume_cells(r["streaming_resume_s"], ".2f")
    for workers in (0, 1, 2):
        m = r[f"streaming_{workers}_workers"]
        resume = streamed if workers == 0 else ("-", "-")
        lines.append(f"| streaming, {workers} worker{'' if workers == 1 else 's'} | {m['tokens_per_s']:,.0f} | "
                     f"{m['first_batch_s']:.2f} s | {resume[0]} | {resume[1]} |")
    prepared = _resume_cells(r["prepared_resume_s"], ".3f")
    for workers in (0, 2):
        m = r[f"prepared_{workers}_workers"]
        resume = prepared if workers == 2 else ("-", "-")
        lines.append(f"| prepared shards, {workers} workers | {m['tokens_per_s']:,.0f} | "
                     f"{m['first_batch_s']:.3f} s | {resume[0]} | {resume[1]} |")
    needs = report["gpu_needs"]
    lines += ["", "What each shipped GPU config consumes (the planner's projection at its stated MFU, not a "
              "measurement), against the rate of prepared shards with 2 workers above:", "",
              "| preset | arch | hardware, config | MFU | projected tokens/s | headroom of prepared data |",
              "|---|---|---|---|---|---|"]
    for n in needs:
        lines.append(f"| {n['preset']} | {n['arch']} | {n['gpus']} x {n['gpu']}, `{n['config']}` | "
                     f"{100 * n['mfu']:.0f}% | {n['projected_tokens_per_s']:,.0f} | "
                     f"{rate / n['projected_tokens_per_s']:,.1f}x |")
    fastest = max(needs, key=lambda n: n["projected_tokens_per_s"])
    lines += ["", f"The fastest config ({fastest['preset']} {fastest['arch']}, {fastest['gpus']} x {fastest['gpu']}, "
              f"`{fastest['config']}`) needs {fastest['projected_tokens_per_s']:,.0f} tokens/s; prepared shards "
              f"delivered {rate / fastest['projected_tokens_per_s']:,.1f}x that here."]
    return "\n".join(lines)


def _corpus_problem(work: str, files: int, corpus_mb: float) -> str | None:
    """Why the corpus in `work`/c4 cannot serve this run: its settings are not these, or not recorded."""
    if not os.path.isdir(os.path.join(work, "c4")):
        return None
    try:
        with open(os.path.join(work, CORPUS_RECORD)) as f:
            found = json.load(f)
        recorded = f"--files {found['files']} --corpus_mb {found['corpus_mb']}"
    except FileNotFoundError:
        return (f"error: --work {work} holds c4/ without the {CORPUS_RECORD} that records its settings (not made by "
                "this version of the command); pass another --work, or remove that c4/ to have it written again")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return (f"error: --work {work}: its {CORPUS_RECORD} cannot be read ({type(e).__name__}: {e}); pass another "
                "--work, or remove c4/ and that file to have the corpus written again")
    if found != {"files": files, "corpus_mb": corpus_mb}:
        return f"error: --work {work} holds a corpus of {recorded}; pass those, or another --work"
    return None


def _corpus(work: str, files: int, corpus_mb: float) -> None:
    """The corpus in `work`/c4, written once (`_corpus_problem` has refused a --work whose corpus cannot serve)."""
    settings = {"files": files, "corpus_mb": corpus_mb}
    if os.path.isdir(os.path.join(work, "c4")):
        return
    write_corpus(os.path.join(work, "c4.partial"), files, corpus_mb)
    with open(os.path.join(work, CORPUS_RECORD), "w") as f:  # before c4/ exists: c4/ is never without its record
        json.dump(settings, f)
    os.rename(os.path.join(work, "c4.partial"), os.path.join(work, "c4"))


def check(args: argparse.Namespace) -> None:
    """What main checks before anything is computed or written: ValueError in one line for a bad value; SystemExit
    with its line for a --work folder that another corpus or prepare holds."""
    problems = [f"--{name} must be positive, got {value}" for name, value in
                (("corpus_mb", args.corpus_mb), ("files", args.files), ("steps", args.steps)) if value <= 0]
    if problems:
        raise ValueError("; ".join(problems))
    check_markdown_path(args.benchmarks_md)
    problem = _corpus_problem(args.work, args.files, args.corpus_mb) or _prepared_problem(args.work)
    if problem:
        raise SystemExit(problem)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Measure the data pipeline's tokens/s and resume time.")
    p.add_argument("--work", default="runs/data_benchmark", help="folder for the corpus and the prepared shards")
    p.add_argument("--corpus_mb", type=float, default=40.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="steps timed per pipeline")
    add_publish_arguments(p, "data_benchmark.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check(args)
    except ValueError as error:
        p.error(str(error))
    needs = gpu_needs()  # before hours of measuring: a config the planner cannot read fails now
    _corpus(args.work, args.files, args.corpus_mb)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(),
              "command": "python -m adaptive_ds.tools.data_benchmark "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "seq_len": SEQ_LEN, "rows": ROWS, "steps": args.steps, **measure(args.work, args.steps),
              "gpu_needs": needs}
    text = markdown(report)
    print(text)
    print(f"report: {write_report(args.out if args.out is not None else args.work, KEY, report)}")
    if args.benchmarks_md:
        replace_section(args.benchmarks_md, KEY, text, "Data pipeline (measured)")


if __name__ == "__main__":
    main()
