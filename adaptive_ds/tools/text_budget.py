"""Text budget: the token budget at which a dense model's validation loss on a prepared corpus has flattened, read
off one pilot run, so that a grid on real text compares models at a budget that can decide.

    python -m adaptive_ds.tools.text_budget --data DIR [--max_tokens 3000000] [--threshold 0.05]
    python -m adaptive_ds.tools.text_budget --data DIR --run_dir RUN     (read a finished pilot, train nothing)

The pilot is one dense run of the full harness (`python -m adaptive_ds.training`, in a process of its own, at the
ds_config's shipped warm-up) on the prepared directory --data, over --max_tokens tokens, with its validation loss on
--eval_batches held-out batches at --evaluations points spread over the run (`--eval_steps`). A run directory under
--work is named after its settings and the corpus's hash, so the same command keeps a finished pilot. A pilot that
reads the corpus's training split more than once is warned about: a loss that flattens on repeated text may be
memorising it.

The rule. For each evaluated token count B, the least-squares slope of the validation loss against tokens over the
evaluations in [0.8 B, B] (the last fifth of a budget of B; at least --min_points of them, else undecided), in nats
per million tokens. The budget is the smallest B at which that slope is above -THRESHOLD and stays so at every later
evaluation: the loss has flattened and does not fall steeply again, so one noisy evaluation does not decide. Where
no B qualifies up to the pilot's end, the tool says so and proposes --max_tokens. The report also gives the smallest
B whose own slope qualifies, and the slope over the pilot's last fifth (a run of budget --max_tokens).

The pilot's learning rate decays over --max_tokens, so at B < --max_tokens it has not decayed as far as at the end
of a run of budget B: the slope at B says how fast the loss still falls at B, not what the last fifth of a run of
budget B shows, whose decay adds a drop of its own.

The threshold, 0.05 nats per 1M tokens by default: at that slope the last fifth of a 3M-token budget moves the loss
by 0.03 nats, within the seed-to-seed standard deviations of the validation losses in BENCHMARKS.md's section
grid:debug:text-prepared, so the last stretch of training moves dense by no more than its seeds already differ.

It writes the report `text-budget_<preset>_<data>.json` into --out (default: --work), with the curve, each slope, the
threshold, the budget, the corpus's hash (`adaptive_ds.data.identity`), the command, commit, machine and the compute
spent, and prints the section; the section goes into a Markdown file between ``<!-- text-budget:PRESET:DATA -->``
markers only when --benchmarks_md names one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shlex

from ..data.identity import describe, prepared_hash
from ..data.prepared import read_manifest
from ..ds_config import ConfigError as DsConfigError
from ..ds_config import resolve as resolve_ds_config
from ..markdown_sections import replace_section
from ..presets import PRESETS
from .grid_runs import PROVENANCE, execute
from .grid_spec import data_name
from .report import add_publish_arguments, check_markdown_path, device_kind, write_report

logger = logging.getLogger(__name__)

KIND = "text-budget"
MAX_TOKENS, THRESHOLD, EVALUATIONS, EVAL_BATCHES, MIN_POINTS = 3_000_000, 0.05, 60, 8, 5
WINDOW = 0.2  # the last fifth of a budget
PILOT_ARCH = "dense"  # what the pilot trains, and what a --run_dir must have trained
MILLION = 1_000_000


def least_squares_slope(points: list[tuple[float, float]]) -> tuple[float, float | None]:
    """The ordinary least-squares slope of y against x over `points` (at least two distinct x), and its standard
    error (None for two points: no residual degree of freedom)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    if n < 3:
        return slope, None
    residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points)
    return slope, math.sqrt(residual / (n - 2) / sxx)


def slopes(curve: list[tuple[int, float]], min_points: int = MIN_POINTS) -> list[dict]:
    """Each evaluation (tokens, validation loss) of `curve`, in token order, with the least-squares slope of the loss
    over the evaluations in [0.8 B, B], B its tokens, in nats per million tokens (None with fewer than `min_points`
    of them), its standard error and the number of evaluations it rests on."""
    rows = []
    for tokens, loss in curve:
        # 5 t >= 4 B: the window's lower end in whole numbers, exactly
        window = [(t / MILLION, v) for t, v in curve if 5 * t >= 4 * tokens and t <= tokens]
        slope, se = least_squares_slope(window) if len(window) >= max(2, min_points) else (None, None)
        rows.append({"tokens": tokens, "validation_loss": loss, "slope_per_million": slope, "slope_se": se,
                     "points": len(window)})
    return rows


def flat(row: dict, threshold: float) -> bool:
    return row["slope_per_million"] is not None and row["slope_per_million"] > -threshold


def choose(rows: list[dict], threshold: float) -> tuple[int | None, int | None]:
    """(budget, first flat): the smallest evaluated token count from which every slope is above -`threshold`, and
    the smallest whose own slope is; None where none is."""
    budget = None
    for row in reversed(rows):
        if not flat(row, threshold):
            break
        budget = row["tokens"]
    first = next((row["tokens"] for row in rows if flat(row, threshold)), None)
    return budget, first


def read_pilot(run_dir: str) -> dict:
    """A finished pilot's validation curve [(tokens, loss)], the standard errors, its identity, summary and
    provenance; ValueError, in one line, for a directory that is not a finished dense run with evaluations."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        with open(os.path.join(run_dir, "run_identity.json")) as f:
            identity = json.load(f)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, filter(str.strip, f)) if "validation_loss" in r]
    except (OSError, ValueError) as e:
        raise ValueError(f"--run_dir {run_dir!r} is not a finished training run ({e})") from None
    if identity["arch"] != PILOT_ARCH:
        raise ValueError(f"--run_dir {run_dir!r} trained {identity['arch']}; the pilot is a {PILOT_ARCH} run")
    if len(records) < 2:
        raise ValueError(f"--run_dir {run_dir!r} validated {len(records)} time(s); the pilot needs a validation "
                         "curve (train it with --eval_steps)")
    tokens_per_step = identity["rows_per_step"] * summary["seq_len"]
    trained = dict.fromkeys(("commit", "machine", "date"), "unknown")
    if os.path.exists(os.path.join(run_dir, PROVENANCE)):
        with open(os.path.join(run_dir, PROVENANCE)) as f:
            trained = json.load(f)
    return {"curve": [(r["step"] * tokens_per_step, r["validation_loss"]) for r in records],
            "se": [r.get("validation_loss_se") for r in records], "steps": [r["step"] for r in records],
            "identity": identity, "summary": summary, "tokens_per_step": tokens_per_step, "trained": trained}


def check_corpus(pilot: dict, corpus: dict, data: str) -> None:
    """The pilot read the prepared directory `data`: its tokenizer is that corpus's (ValueError otherwise)."""
    tokenizer = pilot["identity"]["tokenizer"]
    if tokenizer != f"sha256:{corpus['tokenizer_sha256']}":
        raise ValueError(f"the pilot trained with tokenizer {tokenizer}, not --data {data}'s "
                         f"(sha256:{corpus['tokenizer_sha256']}): it read another corpus")


def pilot_args(args: argparse.Namespace) -> list[str]:
    """The pilot's training command line (its --output_dir aside), checked as the training checks it, with
    --eval_steps spreading --evaluations validations over its steps; SystemExit, in one line, for a bad setting."""
    from ..training.arguments import ConfigError, parse

    base = ["--ds_config", args.ds_config, "--preset", args.preset, "--arch", PILOT_ARCH, "--data", args.data,
            "--tokens", str(args.max_tokens), "--seed", str(args.seed), "--resume", "never",
            "--eval_batches", str(args.eval_batches)]
    try:
        settings, ds_config = parse(base, world_size=1)
    except (ConfigError, DsConfigError) as error:
        raise SystemExit(f"error: {error}") from None
    rows = ds_config["train_micro_batch_size_per_gpu"] * ds_config.get("gradient_accumulation_steps", 1)
    steps = -(-args.max_tokens // (rows * PRESETS[settings.preset].seq_len))
    return [*base, "--eval_steps", str(max(1, steps // args.evaluations))]


def train_pilot(args: argparse.Namespace, corpus_sha256: str) -> str:
    """Train the pilot under --work unless it finished there earlier (named after its command line, its ds_config's
    text and the corpus's hash, so a changed corpus trains anew); returns its directory."""
    argv = pilot_args(args)
    with open(resolve_ds_config(args.ds_config), "rb") as f:
        key = json.dumps(argv).encode() + f.read() + corpus_sha256.encode()
    run_dir = os.path.join(args.work, f"{args.preset}-{data_name(args.data)}-{PILOT_ARCH}-seed{args.seed}-"
                                      f"{hashlib.sha256(key).hexdigest()[:10]}")
    failure = execute(argv, run_dir)
    if failure:
        raise SystemExit(f"error: the pilot failed (exit {failure['exit']}; log {failure['log']}), its log ends:\n"
                         + failure["log_tail"])
    return run_dir


def command(args: argparse.Namespace) -> str:
    """The command that makes this report again (where it writes aside)."""
    parts = ["python", "-m", "adaptive_ds.tools.text_budget", "--data", args.data]
    if args.run_dir:
        parts += ["--run_dir", args.run_dir]
    else:
        parts += ["--preset", args.preset, "--ds_config", args.ds_config, "--seed", str(args.seed), "--max_tokens",
                  str(args.max_tokens), "--evaluations", str(args.evaluations), "--eval_batches",
                  str(args.eval_batches)]
    return shlex.join([*parts, "--threshold", str(args.threshold), "--min_points", str(args.min_points)])


def assemble(pilot: dict, args: argparse.Namespace, data_hash: dict, manifest: dict, run_dir: str) -> dict:
    """The report of a pilot read by `read_pilot` on the prepared directory whose manifest is `manifest`."""
    rows = slopes(pilot["curve"], args.min_points)
    for row, se, step in zip(rows, pilot["se"], pilot["steps"], strict=True):
        row.update(step=step, validation_loss_se=se)
    budget, first = choose(rows, args.threshold)
    identity, summary = pilot["identity"], pilot["summary"]
    vocab = identity["model"]["vocab_size"]
    return {
        "preset": identity["preset"], "seed": identity["seed"], "data": args.data, "data_name": data_name(args.data),
        "data_hash": data_hash, "ds_config": None if args.run_dir else args.ds_config,
        "max_tokens": summary["tokens_seen"], "corpus_train_tokens": manifest["train"]["tokens"],
        "tokens_per_step": pilot["tokens_per_step"],
        "eval_steps": pilot["steps"][0], "threshold_per_million": args.threshold, "window": WINDOW,
        "min_points": args.min_points, "curve": rows, "budget": budget, "first_flat": first,
        "proposed_tokens": budget if budget is not None else summary["tokens_seen"],
        "last_fifth_slope_per_million": rows[-1]["slope_per_million"], "vocab_size": vocab,
        "uniform_loss": math.log(vocab), "wall_time_s": summary["wall_time_s"],
        "run_dir": os.path.relpath(run_dir, args.work) if not args.run_dir else run_dir,
        "command": command(args), **pilot["trained"],
    }


def section_key(report: dict) -> str:
    return f"{KIND}:{report['preset']}:{report['data_name']}"


def _verdict(report: dict) -> str:
    threshold = report["threshold_per_million"]
    if report["budget"] is not None:
        row = next(r for r in report["curve"] if r["tokens"] == report["budget"])
        text = (f"**Budget: {report['budget']:,} tokens**: the validation loss there is {row['validation_loss']:.4f} "
                f"and its slope over the last fifth {row['slope_per_million']:+.4f} nats per 1M tokens, above "
                f"-{threshold:g}, as at every later evaluation.")
        if report["first_flat"] != report["budget"]:
            text += (f" An earlier evaluation, at {report['first_flat']:,} tokens, had a slope above -{threshold:g}, "
                     "but a later one fell below it again.")
        return text
    last = report["last_fifth_slope_per_million"]
    slope = "too few evaluations to tell" if last is None else f"{last:+.4f} nats per 1M tokens"
    return (f"**No budget up to {report['max_tokens']:,} tokens**: the validation loss has not flattened (the slope "
            f"over the pilot's last fifth: {slope}, the threshold -{threshold:g}). Proposed: "
            f"{report['proposed_tokens']:,} tokens, the pilot's whole budget, at which the models are still improving.")


def _shown(rows: list[dict], keep: set[int], most: int = 20) -> list[dict]:
    """At most about `most` evenly spaced evaluations, and those whose tokens are in `keep`, and the last."""
    stride = -(-len(rows) // most)
    return [r for i, r in enumerate(rows) if (len(rows) - 1 - i) % stride == 0 or r["tokens"] in keep]


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a text-budget report: provenance, rule, verdict and the curve."""
    threshold, every = report["threshold_per_million"], report["eval_steps"] * report["tokens_per_step"]
    epochs, hours = report["max_tokens"] / report["corpus_train_tokens"], report["wall_time_s"] / 3600
    lines = [
        f"Measured {report['date']} on {report['machine']}, commit {report['commit']}: `{report['command']}` (one "
        f"dense run of {report['max_tokens']:,} tokens, preset {report['preset']}, seed {report['seed']}, "
        + (f"at the warm-up of `{report['ds_config']}`" if report["ds_config"] else "trained as its run directory says")
        + f"; its validation loss every {report['eval_steps']} steps, {every:,} tokens). Corpus: "
        f"`{report['data']}`, {describe(report['data_hash'])}; {report['corpus_train_tokens']:,} training tokens, "
        f"so the pilot read {epochs:.2f} epochs. Compute: {hours:.2f} {device_kind(report['machine'])}-hours (one "
        "process).",
        "",
        f"Rule: the budget is the smallest evaluated token count B from which the least-squares slope of the "
        f"validation loss against tokens over [0.8 B, B] (at least {report['min_points']} evaluations) stays above "
        f"-{threshold:g} nats per 1M tokens. A uniform guess over the {report['vocab_size']:,} tokens scores "
        f"{report['uniform_loss']:.2f}.",
        "",
        _verdict(report),
        "",
        "| tokens | validation loss | slope over [0.8 B, B] (nats per 1M tokens) | its SE | evaluations | flat |",
        "|---|---|---|---|---|---|",
    ]
    keep = {report["budget"], report["first_flat"]}
    for r in _shown(report["curve"], keep):
        slope = "-" if r["slope_per_million"] is None else f"{r['slope_per_million']:+.4f}"
        se = "-" if r["slope_se"] is None else f"{r['slope_se']:.4f}"
        mark = "yes" if flat(r, threshold) else ("-" if r["slope_per_million"] is None else "no")
        lines.append(f"| {r['tokens']:,} | {r['validation_loss']:.4f} | {slope} | {se} | {r['points']} | {mark} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description="Pick a text budget from one pilot dense run: the "
                                "smallest token count at which its validation loss has flattened.")
    p.add_argument("--data", required=True, help="the prepared directory (python -m adaptive_ds.data.prepare) the "
                                                 "grid will train on")
    p.add_argument("--preset", default="debug", choices=list(PRESETS))
    p.add_argument("--ds_config", default="ds_configs/debug_cpu.json", help="as the training's --ds_config; its "
                                                                            "warm-up is the pilot's")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max_tokens", type=int, default=MAX_TOKENS, help="the pilot's budget, the most proposed")
    p.add_argument("--evaluations", type=int, default=EVALUATIONS, help="validations spread over the pilot")
    p.add_argument("--eval_batches", type=int, default=EVAL_BATCHES, help="held-out batches of each validation")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help="flattened: the slope over the last fifth above minus this, in nats per 1M tokens")
    p.add_argument("--min_points", type=int, default=MIN_POINTS, help="the fewest evaluations a slope rests on")
    p.add_argument("--run_dir", help="read this finished pilot (a dense training run with --eval_steps) instead of "
                                     "training one")
    p.add_argument("--work", default="runs/text-budget", help="the pilot's run directory is made here")
    add_publish_arguments(p, "text-budget_PRESET_DATA.json")
    return p


def check(args: argparse.Namespace) -> None:
    """Bad settings and a --data or --run_dir that does not exist, in one line each (SystemExit), before anything
    trains or reads the corpus."""
    if not args.threshold > 0:
        raise SystemExit(f"error: --threshold {args.threshold} must be above 0 (nats per 1M tokens; e.g. {THRESHOLD})")
    for name in ("max_tokens", "evaluations", "eval_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} {getattr(args, name)} must be at least 1")
    if args.min_points < 2:
        raise SystemExit(f"error: --min_points {args.min_points} must be at least 2 (a slope needs two evaluations)")
    try:
        check_markdown_path(args.benchmarks_md)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    for name in ("data", "run_dir"):
        path = getattr(args, name)
        if path is not None and not os.path.isdir(path):
            raise SystemExit(f"error: --{name} {path!r}: no such directory"
                             + ("; pass a prepared directory (python -m adaptive_ds.data.prepare)" if name == "data"
                                else "; pass a finished pilot run's output directory"))


def _corpus_hash(data: str) -> dict:
    try:
        return prepared_hash(data)
    except ValueError as error:
        raise SystemExit(f"error: --data: {error}") from None


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    check(args)
    data_hash = _corpus_hash(args.data)
    run_dir = args.run_dir or train_pilot(args, data_hash["sha256"])
    try:
        pilot = read_pilot(run_dir)
        manifest = read_manifest(args.data)
        check_corpus(pilot, manifest, args.data)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    report = assemble(pilot, args, data_hash, manifest, run_dir)
    if report["max_tokens"] > report["corpus_train_tokens"]:
        logger.warning("the pilot read the corpus's %s training tokens more than once: a loss that flattens on "
                       "repeated text may be memorising it; prepare more text for a budget this large",
                       f"{report['corpus_train_tokens']:,}")
    text = markdown(report)
    key = section_key(report)
    print(text)
    print(f"report: {write_report(args.out or args.work, key, report)}")
    if args.benchmarks_md:
        replace_section(args.benchmarks_md, key, text, f"Text budget, {report['preset']} on {report['data']} "
                        "(measured)")


if __name__ == "__main__":
    main()
