"""What a run measures: routing statistics, throughput, memory; and where it writes them (metrics.jsonl)."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..flops import training_flops_per_token
from ..models.configuration import AdaptiveDSConfig
from .checkpoint.storage import write_json

logger = logging.getLogger(__name__)


def load_balance(counts: torch.Tensor) -> float:
    """Normalised entropy of an expert load: H(counts / sum) / log(num_experts); 1.0 is perfectly even."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts.double() / total
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return entropy / math.log(len(counts))


class RoutingWindow:
    """Routing statistics of the micro-batches since the last log, from the model's outputs.

    `add` keeps running sums on the device (no host synchronisation per micro-batch); `summary()` reads them once
    per window and is collective: every rank calls it at the same step, and MoE loads are summed over ranks.
    """

    def __init__(self, config: AdaptiveDSConfig):
        self.config = config
        # FLOPs reduction is against the same model with every block run on every token.
        self._unrouted_flops = training_flops_per_token(config.unrouted(), config.max_position_embeddings)
        self.reset()

    def reset(self) -> None:
        self.expert_counts: torch.Tensor | None = None  # (moe layers, experts) demand
        self.dropped: torch.Tensor | float = 0.0
        self.aux_loss: torch.Tensor | float = 0.0
        self.z_loss: torch.Tensor | float = 0.0
        self.moe_outputs = 0
        self.routed: torch.Tensor | None = None  # (mod blocks,) tokens that ran each block
        self.offered = 0  # tokens offered to each MoD block
        self.predictor_correct: torch.Tensor | float = 0.0
        self.predictor_tokens: torch.Tensor | float = 0.0
        self.predictor_loss: torch.Tensor | float = 0.0
        self.predictor_outputs = 0

    def add(self, output) -> None:
        if output.expert_counts is not None:
            counts = torch.stack([c.detach().float() for c in output.expert_counts])
            self.expert_counts = counts if self.expert_counts is None else self.expert_counts + counts
            self.dropped = self.dropped + torch.stack([d.float() for d in output.expert_dropped]).sum()
            self.aux_loss = self.aux_loss + output.aux_loss.detach()
            self.z_loss = self.z_loss + output.z_loss.detach()
            self.moe_outputs += 1
        if output.mod_routing is not None:
            routed = torch.stack([r.routed.sum() for r in output.mod_routing]).float()
            self.routed = routed if self.routed is None else self.routed + routed
            self.offered += output.mod_routing[0].routed.numel()
            if output.mod_predictor_loss is not None:
                self.predictor_correct = self.predictor_correct + sum(r.predictor_correct for r in output.mod_routing)
                self.predictor_tokens = self.predictor_tokens + sum(r.predictor_tokens for r in output.mod_routing)
                self.predictor_loss = self.predictor_loss + output.mod_predictor_loss.detach()
                self.predictor_outputs += 1

    def summary(self) -> dict:
        stats = {}
        if self.expert_counts is not None:
            per_layer = _sum_over_ranks(self.expert_counts.cpu())  # (moe layers, experts)
            assignments = float(per_layer.sum())
            dropped = float(_sum_over_ranks(torch.as_tensor(self.dropped).reshape(1).cpu()))
            dead = [f"{layer}:{expert}" for layer, expert in (per_layer == 0).nonzero().tolist()]
            stats["moe"] = {
                "tokens_per_expert": per_layer.sum(0).long().tolist(),
                "expert_utilisation": (per_layer > 0).float().mean().item(),
                "load_balance": sum(load_balance(c) for c in per_layer) / len(per_layer),
                "dropped_fraction": dropped / assignments if assignments else 0.0,
                "aux_loss": float(self.aux_loss) / self.moe_outputs,
                "z_loss": float(self.z_loss) / self.moe_outputs,
                "dead_experts": dead,  # "moe layer:expert" pairs that received no token in the window
            }
        if self.routed is not None and self.offered:
            routed = self.routed.cpu()
            fractions = (routed / self.offered).tolist()
            flops = training_flops_per_token(self.config, self.config.max_position_embeddings, fractions)
            stats["mod"] = {
                "skip_rate": 1.0 - float(routed.sum()) / (self.offered * len(routed)),
                "flops_reduction": 1.0 - flops / self._unrouted_flops,
            }
            if self.predictor_outputs:
                stats["mod"]["predictor_accuracy"] = float(self.predictor_correct) / float(self.predictor_tokens)
                stats["mod"]["predictor_loss"] = float(self.predictor_loss) / self.predictor_outputs
        return stats


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t


def peak_memory() -> dict:
    """Peak memory of this process: GPU allocator peak when on CUDA, else the resident-set high-water mark."""
    if torch.cuda.is_available():
        return {"device": "cuda", "peak_allocated_bytes": torch.cuda.max_memory_allocated()}
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"device": "cpu", "peak_rss_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024}


class PhaseClock:
    """A run's wall time split into phases: ``with clock.phase("eval"): ...`` charges the block to "eval".

    A phase opened inside another is charged to the inner one only, so the phases add up to the wall time;
    what no phase claims (logging, plots, the summary) is "other". Each rank keeps its own clock.
    `process_started` (epoch seconds): the time before the clock existed (interpreter start, imports) counts
    as setup and as wall time.
    """

    PHASES = ("setup", "data", "train", "checkpoint", "eval")

    def __init__(self, process_started: float | None = None):
        before = max(0.0, time.time() - process_started) if process_started else 0.0
        self.started = time.perf_counter() - before
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.seconds["setup"] = before
        self._inner: list[float] = []  # per open phase: the seconds already charged to phases inside it

    @contextmanager
    def phase(self, name: str):
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(self.PHASES)}")
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.seconds[name] += elapsed - self._inner.pop()
            if self._inner:
                self._inner[-1] += elapsed

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def breakdown(self) -> dict[str, float]:
        """Seconds per phase, "other", and "total" (the wall time so far)."""
        total = self.elapsed()
        return {**self.seconds, "other": total - sum(self.seconds.values()), "total": total}


class LossWindow:
    """The step losses and busy time of one logging window (tokens/s counts data and train time only). A step's
    tokens count when it trains; its loss arrives when the loop reads the window's losses from the device."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock
        self.restart()

    def _busy(self) -> float:
        return self.clock.seconds["data"] + self.clock.seconds["train"]

    def restart(self) -> None:
        self.losses: list[float] = []
        self.tokens = 0
        self.started = self._busy()

    def add_tokens(self, tokens: int) -> None:
        self.tokens += tokens

    def add_losses(self, losses: list[float]) -> None:
        self.losses += losses

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)

    def busy_seconds(self) -> float:
        return self._busy() - self.started

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.busy_seconds(), 1e-9)


SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
ABANDONED_METRICS = "abandoned_metrics.jsonl"


def _flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a (nested) record, with names like moe/load_balance."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            flat[f"{prefix}{key}"] = float(value)
    return flat


class MetricsWriter:
    """Appends one JSON object per logged step to OUTPUT_DIR/metrics.jsonl, and mirrors the numeric values to
    TensorBoard (OUTPUT_DIR/tensorboard) or Weights & Biases when asked. Rank 0 only: other ranks pass None.

    metrics.jsonl holds one record per step: when a run goes back (a rollback, or a resume from a checkpoint
    older than the last record), `rewind(step)` moves the records after `step` to OUTPUT_DIR/abandoned_metrics.jsonl,
    each marked `"abandoned": true`, so the history is kept but a reader of metrics.jsonl never sees a step twice.
    """

    def __init__(self, output_dir: str | None, report_to: str = "none", run_name: str = "", config: dict | None = None,
                 log_steps: int = 1):
        self._file = self._tensorboard = self._wandb = None
        self.output_dir, self.log_steps = output_dir, log_steps
        if output_dir is None:
            return
        self.path = os.path.join(output_dir, METRICS)
        self._file = open(self.path, "a")  # closed in close()
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # the logging extra; checked when the run starts

            self._tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        elif report_to == "wandb":
            import wandb  # the logging extra; checked when the run starts

            self._wandb = wandb.init(name=run_name, config=config, dir=output_dir)

    def should_log(self, step: int, max_steps: int) -> bool:
        """The logging cadence: every `log_steps` steps and the last step (collective: the same on every rank)."""
        return step % self.log_steps == 0 or step == max_steps

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        values = _flatten(record)
        if self._tensorboard:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, record["step"])
            self._tensorboard.flush()
        if self._wandb:
            self._wandb.log(values, step=record["step"])

    def rewind(self, step: int, reason: str) -> int:
        """Move the records after `step` to abandoned_metrics.jsonl (marked, with `reason`); returns how many.

        Reads the file from its end and truncates it in place, so the cost is the abandoned records', not the run's.
        """
        if self._file is None:
            return 0
        self._file.close()
        cut = _offset_after(self.path, step)
        with open(self.path, "rb") as f:
            f.seek(cut)
            tail = f.read().decode()
        abandoned = [{**json.loads(line), "abandoned": True, "abandoned_because": reason}
                     for line in tail.splitlines() if _step_of(line.encode()) is not None]
        if abandoned:  # the evidence first, then the cut: a crash in between duplicates, never loses, a record
            with open(os.path.join(self.output_dir, ABANDONED_METRICS), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in abandoned)
                f.flush()
                os.fsync(f.fileno())
            os.truncate(self.path, cut)
        self._file = open(self.path, "a")  # closed in close()
        return len(abandoned)

    def amend(self, step: int, fields: dict) -> None:
        """Add `fields` to the record of `step`, the file's last (or write a record of `step` alone, where the step
        logged none): for what is known only after the step's record was written, such as the failed save that ends
        the run. Reads and rewrites the last record only."""
        if self._file is None:
            return
        self._file.close()
        cut = _offset_after(self.path, step - 1)
        with open(self.path, "rb") as f:
            f.seek(cut)
            tail = [line for line in f.read().splitlines() if _step_of(line) == step]
        record = {**(json.loads(tail[-1]) if tail else {"step": step}), **fields}
        os.truncate(self.path, cut)
        self._file = open(self.path, "a")  # closed in close()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self._tensorboard:
            self._tensorboard.close()
        if self._wandb:
            self._wandb.finish()


def _offset_after(path: str, step: int, chunk: int = 1 << 16) -> int:
    """The byte offset in a metrics.jsonl (steps increasing) where the records after `step` begin, found by reading
    from the end in growing windows. A torn last line (a kill mid-write) counts as after every step."""
    size = os.path.getsize(path)
    window = chunk
    with open(path, "rb") as f:
        while True:
            start = max(0, size - window)
            f.seek(start)
            data = f.read()
            # Past the window's first newline every line is whole (at the start of the file, all of them are).
            first = 0 if start == 0 else data.find(b"\n") + 1
            if start == 0 or first > 0:
                end = len(data)
                for line in reversed(data[first:].split(b"\n")):
                    end -= len(line) + 1  # where this line begins, less one
                    found = _step_of(line)
                    if found is not None and found <= step:
                        return start + end + 1 + len(line) + 1
            if start == 0:
                return 0
            window *= 2


def _step_of(line: bytes) -> int | None:
    try:
        return json.loads(line)["step"] if line.strip() else None
    except json.JSONDecodeError:
        return None


def write_summary(output_dir: str, summary: dict) -> None:
    """OUTPUT_DIR/summary.json, the run's figures (docs/training.md), written atomically: a reader never finds half
    of it."""
    write_json(os.path.join(output_dir, SUMMARY), summary)
