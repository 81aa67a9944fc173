"""Where a trained model's loss goes on the embedded corpus: its excess over the generator's, by kind of token.

The embedded corpus knows the true probability of every token (`adaptive_ds.data.embedded`) and what each token
is (`Document.kinds`): a memorised fact's value, an entity's name, a computed digit, a value copied from context,
or anything else, determined (p = 1) or uncertain. A model's validation loss minus the entropy floor is the sum,
over these kinds, of each kind's share of the tokens times the model's excess loss on it, so the breakdown says
which structure a model has not learned yet, and whether a bigger model (more parameters: MoE) should help there.

Fact values are split by their entity's Zipf rank; each bucket also shows how many times a training run of
`--train_tokens` tokens stated each of its facts (counted on the run's own training stream), which separates a
fact the model has not seen often enough from one it has no room for.

    python -m adaptive_ds.tools.loss_breakdown --models dense=RUNS/dense-seed1/final moe=RUNS/moe-seed1/final --seed 1

`--seed` must be the runs' training seed: the held-out blocks are that run's validation stream. The models run
on the CPU (a debug-preset model scores 256 blocks in seconds).

It writes the JSON report into --out (default `runs/loss_breakdown`), named after its section
(`loss-breakdown_<seq_len>_<tier>[_<name>].json`), and prints the table; the table goes into a Markdown file as the
section ``<!-- loss-breakdown:<seq_len>:<tier>[:<name>] -->`` only when --benchmarks_md names one, rendered from the
report alone. Nothing a user runs writes into the repository's committed results unless asked: publishing is
`--out benchmarks --benchmarks_md BENCHMARKS.md`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data import EMBEDDED_SOURCES, build_training_data, train_namespace, validation_namespace
from ..data.embedded import COMPUTED, COPIED, FACT, NAME, NUM_ENTITIES, RELATIONS, TIERS, Document, block
from ..export.convert import load_any
from ..markdown_sections import replace_section
from .report import check_markdown_path, check_name, commit, machine, write_report

logger = logging.getLogger(__name__)

BATCH_SIZE = 16  # held-out rows per forward
# Fact values by their entity's Zipf rank (from 0): the head is stated often, the tail rarely.
FACT_BUCKETS = ((0, 16), (16, 256), (256, NUM_ENTITIES))


def fact_bucket(entity: int) -> str:
    for lo, hi in FACT_BUCKETS:
        if lo <= entity < hi:
            return f"fact value, entity rank {lo + 1}-{hi}"
    raise ValueError(f"entity {entity} is outside the table (0..{NUM_ENTITIES - 1})")


NAMED_KINDS = {NAME: "entity name (Zipf draw)", COMPUTED: "computed digit (sum, product)",
               COPIED: "copied value (recall)"}
DETERMINED, UNCERTAIN = "other, determined (p = 1)", "other, uncertain"
CATEGORIES = (*(fact_bucket(lo) for lo, _ in FACT_BUCKETS), *NAMED_KINDS.values(), DETERMINED, UNCERTAIN)


def fact_entity(kind: str) -> int | None:
    """The entity of a fact value's kind ("fact:17" -> 17); None for any other kind."""
    return int(kind.split(":", 1)[1]) if kind.startswith(FACT + ":") else None


def category(kind: str, logprob: float) -> str:
    """The breakdown's category of a token of `kind` (Document.kinds) with generator log-probability `logprob`."""
    entity = fact_entity(kind)
    if entity is not None:
        return fact_bucket(entity)
    if kind in NAMED_KINDS:
        return NAMED_KINDS[kind]
    if kind:
        raise ValueError(f"unknown token kind {kind!r}")
    return DETERMINED if logprob == 0.0 else UNCERTAIN


def statements_per_fact(blocks: Iterable[Document]) -> dict[str, float]:
    """Per fact bucket: how many times each fact (entity, relation) of the bucket was stated in `blocks`, on
    average. A statement is a maximal run of tokens of one entity's fact kind (a value is 1 to 3 tokens; two
    statements are always separated by a relation token)."""
    statements: dict[str, int] = defaultdict(int)
    for b in blocks:
        previous = ""
        for kind in b.kinds:
            entity = fact_entity(kind)
            if entity is not None and kind != previous:
                statements[fact_bucket(entity)] += 1
            previous = kind
    return {fact_bucket(lo): statements[fact_bucket(lo)] / ((hi - lo) * len(RELATIONS)) for lo, hi in FACT_BUCKETS}


@dataclass
class Sums:
    """Per category: predicted tokens, the generator's summed NLL, the model's summed NLL."""

    tokens: int = 0
    floor: float = 0.0
    model: float = 0.0


@torch.no_grad()
def model_nll(model, batches: Sequence[dict]) -> list[list[float]]:
    """The model's NLL (nats) of every predicted token of each row of `batches` (validation batches: rows shorter
    than the block are padded at the end with labels -100, which no earlier token sees: causal attention, causal
    MoD routing, dropless MoE), in order, padding dropped; MoD blocks route causally (what generation does)."""
    model.eval()
    model.model.set_mod_routing("causal")
    out = []
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none").double()
        out += [row[kept].tolist() for row, kept in zip(nll, labels != -100, strict=True)]
    return out


def tokens_seen(folder: str) -> int | None:
    """The training tokens of the run whose final/ folder this is (its summary.json), None if not known."""
    summary = os.path.join(os.path.dirname(os.path.abspath(folder)), "summary.json")
    if not os.path.isfile(summary):
        return None
    with open(summary) as f:
        return json.load(f).get("tokens_seen")


def breakdown(models: dict[str, str], seed: int, num_blocks: int, train_tokens: int | None = None,
              tier: str = "hard") -> dict:
    """Load each trained model (name -> folder), score the `num_blocks` held-out blocks of seed `seed`, and count
    the facts stated in the first `train_tokens` tokens of that seed's training stream (None: the largest
    `tokens_seen` of the models' runs; a run reads its stream's blocks in order, `EmbeddedData.sample`)."""
    if num_blocks < 1:
        raise ValueError(f"--blocks must be at least 1, got {num_blocks}")
    loaded = {}
    for name, path in models.items():
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--models {name}={path}: no such folder (give a trained run's final/ folder)")
        model, tokenizer = load_any(path)
        loaded[name] = model, tokenizer.get_vocab()
    lengths = {name: model.config.max_position_embeddings for name, (model, _) in loaded.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"the models have different sequence lengths ({lengths}): compare models of one preset")
    seq_len = next(iter(lengths.values()))
    if train_tokens is None:
        seen = [t for t in map(tokens_seen, models.values()) if t is not None]
        if not seen:
            raise ValueError("no model folder sits in a run with a summary.json: give --train_tokens")
        train_tokens = max(seen)
    # the run's own validation batches (the same blocks, ids and padding), and the same blocks with their kinds
    data = build_training_data(next(s for s, t in EMBEDDED_SOURCES.items() if t == tier), seq_len, seed, workers=0)
    for name, (_, vocab) in loaded.items():
        if vocab != data.tokenizer.get_vocab():
            raise ValueError(f"--models {name}: its tokenizer is not the embedded:{tier} corpus's (was it trained "
                             "on another tier or data?)")
    batches = data.validation_batches(BATCH_SIZE, math.ceil(num_blocks / BATCH_SIZE))
    held_out = [block(validation_namespace(seed), i, seq_len, tier) for i in range(num_blocks)]
    train_blocks = math.ceil(train_tokens / seq_len)
    exposures = statements_per_fact(block(train_namespace(seed), i, seq_len, tier) for i in range(train_blocks))
    rows: dict[str, dict[str, Sums]] = {}
    for name, (model, _) in loaded.items():
        sums = {c: Sums() for c in CATEGORIES}
        for b, nll in zip(held_out, model_nll(model, batches)[:num_blocks], strict=True):
            for kind, logprob, loss in zip(b.kinds[1:], b.logprobs[1:], nll, strict=True):
                s = sums[category(kind, logprob)]
                s.tokens += 1
                s.floor -= logprob
                s.model += loss
        rows[name] = sums
    total = sum(s.tokens for s in next(iter(rows.values())).values())
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "commit": commit(), "seed": seed,
              "tier": tier, "blocks": num_blocks, "seq_len": seq_len, "tokens": total,
              "train_tokens": train_tokens, "models": models, "statements_per_fact": exposures, "categories": {}}
    for c in CATEGORIES:
        first = next(iter(rows.values()))[c]
        entry = {"share": first.tokens / total, "tokens": first.tokens,
                 "floor": first.floor / first.tokens if first.tokens else None, "models": {}}
        for name, sums in rows.items():
            s = sums[c]
            excess = (s.model - s.floor) / s.tokens if s.tokens else None
            entry["models"][name] = {"loss": s.model / s.tokens if s.tokens else None, "excess": excess,
                                     "contribution": (s.model - s.floor) / total}
        report["categories"][c] = entry
    report["totals"] = {name: {"loss": sum(s.model for s in sums.values()) / total,
                               "floor": sum(s.floor for s in sums.values()) / total}
                        for name, sums in rows.items()}
    return report


def section_key(report: dict, name: str | None = None) -> str:
    """loss-breakdown:SEQ_LEN:TIER, or loss-breakdown:SEQ_LEN:TIER:NAME."""
    return ":".join(["loss-breakdown", str(report["seq_len"]), report["tier"], *([name] if name else [])])


def markdown(report: dict) -> str:
    """The BENCHMARKS.md section of a report: provenance, then each kind of token's excess loss per model."""
    names = list(report["totals"])
    lines = [f"Measured {report['date']} on {report['machine']}, commit {report['commit']}: `{report['command']}`. "
             f"{report['blocks']} held-out blocks of seed {report['seed']}'s validation stream "
             f"({report['tokens']:,} predicted tokens, embedded:{report['tier']}), MoD routing causal, MoE dropless. "
             "Each model column: its excess loss over the generator on that kind of token (nats/token), then "
             "in brackets that kind's contribution to the model's loss minus the floor (share x excess); the "
             "contributions add up to the last row.", "",
             f"| kind of token | share | floor (nats) | statements per fact in {report['train_tokens']:,} training "
             "tokens (mean over the bucket) | "
             + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
    for c, entry in report["categories"].items():
        seen = report["statements_per_fact"].get(c)
        cells = [f"{m['excess']:.3f} ({m['contribution']:+.4f})" if m["excess"] is not None else "-"
                 for m in entry["models"].values()]
        floor = f"{entry['floor']:.3f}" if entry["floor"] is not None else "-"
        lines.append(f"| {c} | {100 * entry['share']:.1f}% | {floor} | "
                     f"{f'{seen:.1f}' if seen is not None else '-'} | " + " | ".join(cells) + " |")
    cells = [f"{t['loss'] - t['floor']:.4f} (loss {t['loss']:.4f})" for t in report["totals"].values()]
    floor = next(iter(report["totals"].values()))["floor"]
    lines.append(f"| all tokens | 100% | {floor:.3f} | - | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _model_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FOLDER (a trained model's final/ folder), got {text!r}")
    return name, path


def check(args: argparse.Namespace) -> None:
    """What main checks before it loads a model: ValueError in one line."""
    names = [name for name, _ in args.models]
    if len(set(names)) < len(names):
        raise ValueError(f"each --models NAME must be unique, got {', '.join(names)}")
    for name, path in args.models:
        if not os.path.isdir(path):
            raise ValueError(f"--models {name}={path}: no such folder (give a trained run's final/ folder)")
    if args.blocks < 1:
        raise ValueError(f"--blocks must be at least 1, got {args.blocks}")
    check_name(args.name)
    check_markdown_path(args.benchmarks_md)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", type=_model_arg, required=True, metavar="NAME=FOLDER")
    p.add_argument("--seed", type=int, required=True, help="the runs' training seed (its validation stream)")
    p.add_argument("--tier", default="hard", choices=TIERS, help="the embedded corpus's tier the models trained on")
    p.add_argument("--blocks", type=int, default=256,
                   help="held-out blocks to score, the first of the seed's validation stream (a grid run validates "
                        "on its first micro-batch x eval_batches: 128 at debug; more here for a smaller error)")
    p.add_argument("--train_tokens", type=int,
                   help="count fact statements in this many training tokens (default: the largest tokens_seen in "
                        "the models' runs' summary.json)")
    p.add_argument("--out", default="runs/loss_breakdown",
                   help="folder of the JSON report, named after its section (the repository's committed results: "
                        "benchmarks)")
    p.add_argument("--benchmarks_md", help="also write the table as a section of this Markdown file (the "
                                           "repository's: BENCHMARKS.md); by default no file is touched")
    p.add_argument("--name", help="a name for this breakdown (lower-case letters, digits, '-'): its section is "
                                  "loss-breakdown:SEQ_LEN:TIER:NAME, apart from others of the same corpus")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        check(args)
        report = breakdown(dict(args.models), args.seed, args.blocks, args.train_tokens, args.tier)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"loss_breakdown: {e}")
    report["command"] = ("python -m adaptive_ds.tools.loss_breakdown "
                         + " ".join(argv if argv is not None else sys.argv[1:]))
    key = section_key(report, args.name)
    text = markdown(report)
    print(text)
    print(f"report: {write_report(args.out, key, report)}")
    if args.benchmarks_md:
        replace_section(args.benchmarks_md, key, text,
                        f"Where the loss goes, seq {report['seq_len']} on embedded:{report['tier']}")


if __name__ == "__main__":
    main()
