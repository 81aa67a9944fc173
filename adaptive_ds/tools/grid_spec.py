"""What a benchmark grid trains (tools/grid.py): its variants, parsed from the command line (`NAME` of
presets.VARIANTS or `NAME+{JSON}`), and the GridSpec that turns a variant and a seed into a training run's command
line and directory, and the grid into the command that regenerates its section."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
from dataclasses import dataclass, field

from .. import ds_config as ds_config_reader
from .. import pretrained
from ..data import EMBEDDED
from ..presets import VARIANTS, variant_overrides


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str
    model: dict = field(default_factory=dict)
    controller: dict = field(default_factory=dict)
    tokens: int | None = None  # this variant's own token budget (e.g. dense at a cheaper variant's FLOPs)
    # from random weights in a continuation grid ("init_from": null): the from-scratch arm beside the continuations
    scratch: bool = False
    warmup_steps: int | None = None  # this variant's own learning-rate warm-up (over the grid's --warmup_steps)


def parse_variant(text: str) -> Variant:
    """`NAME` of presets.VARIANTS, or `NAME+{JSON}`: the named variant with more model overrides (and "controller"
    settings, and "tokens": its own token budget, e.g. `dense+{"tokens": 278000}` trains dense on the training
    FLOPs a cheaper variant spends on the grid's budget: an iso-FLOP baseline with a complete schedule;
    `"init_from": null`: in a continuation grid, this variant trains from random weights, the from-scratch arm; and
    "warmup_steps": its own learning-rate warm-up, over the grid's --warmup_steps)."""
    base, plus, extra = text.partition("+")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {text!r}; valid: {', '.join(VARIANTS)}, or one of them followed by "
                         "+{JSON object of model overrides}, e.g. 'moe+{\"moe_drop_tokens\": false}'")
    entry = variant_overrides(base)  # what the training run's command line passes over the architecture's defaults
    model, controller = entry.model, entry.controller
    if plus:
        try:
            overrides = json.loads(extra)
        except json.JSONDecodeError as e:
            raise ValueError(f"variant {text!r}: what follows '+' is not JSON ({e})") from None
        if not isinstance(overrides, dict) or not isinstance(overrides.get("controller", {}), dict):
            raise ValueError(f"variant {text!r}: what follows '+' must be a JSON object of model overrides (and "
                             "an object under 'controller'), e.g. 'moe+{\"moe_drop_tokens\": false}'")
        controller.update(overrides.pop("controller", {}))
        tokens = overrides.pop("tokens", None)
        if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"variant {text!r}: 'tokens' must be a positive integer, got {tokens!r}")
        scratch = "init_from" in overrides
        if overrides.pop("init_from", None) is not None:
            raise ValueError(f"variant {text!r}: 'init_from' may only be null (this variant from random weights in a "
                             "continuation grid); the grid's --init_from names the weights")
        warmup = overrides.pop("warmup_steps", None)
        if warmup is not None and (not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0):
            raise ValueError(f"variant {text!r}: 'warmup_steps' must be a whole number of steps, got {warmup!r}")
        model.update(overrides)
        return Variant(text, entry.arch, model, controller, tokens, scratch, warmup)
    return Variant(text, entry.arch, model, controller)


def data_name(data: str) -> str:
    """The data in a section key or file name: embedded:hard -> embedded-hard, /x/docs.json.gz -> docs."""
    name = data if "," in data else os.path.basename(data.rstrip("/")).split(".")[0]
    return re.sub(r"[^a-z0-9]+", "-", (name or data).lower()).strip("-")[:40]


@dataclass(frozen=True)
class GridSpec:
    """What a grid trains: the same preset, data, budget and ds_config for every variant x seed."""

    preset: str
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...]
    tokens: int
    ds_config: str
    data: str = EMBEDDED
    tokenizer: str | None = None
    warmup_steps: int | None = None
    baseline: str = "dense"
    eval_batches: int | None = None
    name: str | None = None  # the last part of the section key and of the report's file names
    # pretrained weights every run starts from (--init_from; "{seed}" in it is each run's seed): a continuation grid
    init_from: str | None = None
    # (variant, baseline) pairs compared apart from the baseline (--pair): a continuation against its from-scratch arm
    pairs: tuple[tuple[str, str], ...] = ()
    log_steps: int | None = None  # the curves' resolution: a short continuation needs more points than the default

    def source(self, seed: int) -> str | None:
        """The --init_from of the run of `seed`: the template with its seed, a glob of it matching one folder (a
        base grid's run directory, whose name ends in a digest: runs/base/debug-embedded-dense-seed{seed}-*/final).
        ValueError when a glob matches no folder or several."""
        if self.init_from is None:
            return None
        path = self.init_from.replace("{seed}", str(seed))
        if any(c in path for c in "*?["):
            matches = sorted(glob.glob(path))
            if len(matches) != 1:
                raise ValueError(f"init_from {path!r} matches {len(matches)} folders; it must match one")
            path = matches[0]
        return path

    @property
    def key(self) -> str:
        """The BENCHMARKS.md section key: grid:PRESET:DATA, or grid:PRESET:DATA:NAME."""
        return ":".join(["grid", self.preset, self.data_name, *([self.name] if self.name else [])])

    @property
    def data_name(self) -> str:
        return data_name(self.data)

    def starts_from(self, variant: Variant) -> bool:
        """Whether `variant`'s runs start from the --init_from weights (not a from-scratch arm)."""
        return self.init_from is not None and not variant.scratch

    def training_args(self, variant: Variant, seed: int) -> list[str]:
        """The training command line of one run, its --output_dir aside."""
        args = ["--ds_config", self.ds_config, "--preset", self.preset, "--arch", variant.arch, "--data", self.data,
                "--tokens", str(variant.tokens or self.tokens), "--seed", str(seed), "--resume", "never"]
        if self.tokenizer is not None:
            args += ["--tokenizer", self.tokenizer]
        if variant.model:
            args += ["--model", json.dumps(variant.model, sort_keys=True)]
        if variant.controller:
            args += ["--controller", json.dumps(variant.controller, sort_keys=True)]
        warmup = variant.warmup_steps if variant.warmup_steps is not None else self.warmup_steps
        if warmup is not None:
            args += ["--warmup_steps", str(warmup)]
        if self.log_steps is not None:
            args += ["--log_steps", str(self.log_steps)]
        if self.eval_batches is not None:
            args += ["--eval_batches", str(self.eval_batches)]
        if self.starts_from(variant):
            args += ["--init_from", self.source(seed)]
        return args

    def run_dir(self, runs_dir: str, variant: Variant, seed: int) -> str:
        """Named after everything that makes the run (its command line, the ds_config's text and the shipped
        settings of its architecture that its overrides leave standing), so that a grid re-run keeps exactly the
        runs it would train again and no others: a change of an architecture's entry in presets.VARIANTS trains anew
        what it changes."""
        with open(ds_config_reader.resolve(self.ds_config), "rb") as f:
            key = json.dumps(self.training_args(variant, seed)).encode() + f.read()
        defaults = {k: v for k, v in VARIANTS[variant.arch].model.items() if k not in variant.model}
        if defaults:  # absent, the key is what it was before the defaults existed: those runs are still kept
            key += json.dumps(defaults, sort_keys=True).encode()
        if self.starts_from(variant):  # the weights it starts from, by content: a retrained base trains anew
            key += pretrained.content_hash(pretrained.resolve(self.source(seed))).encode()
        slug = re.sub(r"[^a-z0-9]+", "-", variant.name.lower()).strip("-")[:40]
        digest = hashlib.sha256(key).hexdigest()[:10]
        return os.path.join(runs_dir, f"{self.preset}-{self.data_name}-{slug}-seed{seed}-{digest}")

    def command(self) -> str:
        parts = ["python", "-m", "adaptive_ds.tools.grid", "--preset", self.preset, "--tokens", str(self.tokens),
                 "--ds_config", self.ds_config, "--data", self.data]
        if self.tokenizer is not None:
            parts += ["--tokenizer", self.tokenizer]
        parts += ["--variants", *(v.name for v in self.variants), "--seeds", *map(str, self.seeds)]
        if self.baseline != "dense":
            parts += ["--baseline", self.baseline]
        if self.warmup_steps is not None:
            parts += ["--warmup_steps", str(self.warmup_steps)]
        if self.log_steps is not None:
            parts += ["--log_steps", str(self.log_steps)]
        if self.eval_batches is not None:
            parts += ["--eval_batches", str(self.eval_batches)]
        if self.name is not None:
            parts += ["--name", self.name]
        if self.init_from is not None:
            parts += ["--init_from", self.init_from]
        for variant, baseline in self.pairs:
            parts += ["--pair", variant, baseline]
        return shlex.join(parts)
