"""Validation: held-out loss per target token with its standard error, on the same batches every time, at its own
cadence. The held-out batches are dealt to the ranks (rank r takes batches r, r + world, ...), so more processes
validate faster rather than repeating each other."""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import distributed

logger = logging.getLogger(__name__)


class Evaluation(NamedTuple):
    loss: float
    se: float
    routed_share: float | None  # MoD: the share of token-block passes that ran a routed block (None: no MoD)


def _chunks(batch: dict, parts: int) -> list[dict]:
    """`batch` split into `parts` micro-batches of rows (some empty when it has fewer rows)."""
    return [dict(zip(batch, rows, strict=True)) for rows in zip(*(v.tensor_split(parts) for v in batch.values()),
                                                               strict=True)]


@torch.no_grad()
def evaluate(engine, batches: list[dict], mod_routing: str = "causal", micro_batch: int | None = None) -> Evaluation:
    """The LM loss per target token over all held-out sequences (the model in eval mode), the standard error of
    that ratio over sequences (the ratio estimator's: sqrt(sum_i (s_i - R n_i)^2 / (N (N - 1))) / mean(n), with
    s_i, n_i a sequence's summed loss and target count, R the loss, N sequences), and the share of tokens that
    ran the MoD blocks. `micro_batch`: the most rows a forward takes (the training's micro-batch, which fits);
    every batch is split into as many forwards as the largest needs, on every rank alike.

    MoD blocks route with `mod_routing`: "causal" (router logit > 0, or the predictor; what generation does, the
    honest figure) or "topk" (the train-time rule, which sees the whole sequence). Causal routing holds no
    capacity below 1.0 (at the blocks' current capacity 1.0 it routes every token, as training does): its routed
    share is measured, since a loss bought with more routed tokens costs more compute.
    """
    model = engine.module.model
    engine.eval()
    model.set_mod_routing(mod_routing)
    # sums over sequences of: s, n, s^2, s n, n^2, 1
    moments = torch.zeros(6, dtype=torch.float64, device=engine.device)
    routing = torch.zeros(2, dtype=torch.float64, device=engine.device)  # routed token-block passes, all passes
    rank, world = distributed.rank(), distributed.world_size()
    largest = max((b["input_ids"].shape[0] for b in batches), default=1)
    parts = -(-largest // (micro_batch or largest))
    for first in range(0, len(batches), world):
        # Every rank runs as many forwards as the others (expert-parallel layers exchange tokens in each one);
        # a rank past the end repeats batch 0, and a chunk without rows runs its first row, neither counted.
        index = first + rank
        for chunk in _chunks(batches[index] if index < len(batches) else batches[0], parts):
            counted = index < len(batches) and chunk["input_ids"].shape[0] > 0
            source = chunk if counted else {k: v[:1] for k, v in batches[0].items()}
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in source.items()}
            out = engine(input_ids=batch["input_ids"])
            if counted:
                _accumulate(out, batch, moments, routing)
    model.set_mod_routing("causal")
    engine.train()
    if distributed.world_size() > 1:
        dist.all_reduce(moments)
        dist.all_reduce(routing)
    s, n, ss, sn, nn, count = moments.tolist()
    routed, passes = routing.tolist()
    share = routed / passes if passes else None
    if n == 0:
        logger.warning("no held-out tokens to validate on: the validation loss is NaN (raise validation_share)")
        return Evaluation(float("nan"), float("nan"), share)
    loss = s / n
    if count < 2:
        return Evaluation(loss, float("nan"), share)
    residual = max(ss - 2 * loss * sn + loss * loss * nn, 0.0)
    return Evaluation(loss, math.sqrt(residual / (count * (count - 1))) / (n / count), share)


def _accumulate(out, batch: dict, moments: torch.Tensor, routing: torch.Tensor) -> None:
    """Add one forward's sums to the running moments (s, n, s^2, s n, n^2, sequences) and routed counts."""
    for block in out.mod_routing or ():
        routing[0] += block.routed.sum()
        routing[1] += block.routed.numel()
    targets = batch["labels"][:, 1:]
    token_loss = F.cross_entropy(out.logits[:, :-1].transpose(1, 2).float(), targets, ignore_index=-100,
                                 reduction="none")  # (batch, seq - 1)
    s = token_loss.double().sum(1)
    n = (targets != -100).double().sum(1)
    moments += torch.stack([s.sum(), n.sum(), (s * s).sum(), (s * n).sum(), (n * n).sum(),
                            torch.tensor(float(len(s)), dtype=torch.float64, device=s.device)])


class Validator:
    """Owns the held-out batches and the cadence: every `eval_steps` steps (0: none during the run) and at the
    run's last step. The loop asks `should_run(step)` after every step, whatever the logging cadence; the end of the
    run takes the validation of its last step (`result_at`) rather than running the same one twice."""

    def __init__(self, batches: list[dict], eval_steps: int, last_step: int, routings: tuple[str, ...]):
        # routings: the model's `validation_routings()`, the honest one first (MoD: then the train-time top-k)
        self.batches, self.eval_steps, self.last_step, self.routings = batches, eval_steps, last_step, routings
        self.latest: tuple[int, dict] | None = None  # (step, losses) of the latest validation

    def should_run(self, step: int) -> bool:
        return step == self.last_step or (bool(self.eval_steps) and step % self.eval_steps == 0)

    def run(self, engine, step: int, micro_batch: int | None = None) -> dict:
        """The held-out losses of the weights at `step`, in forwards of at most `micro_batch` rows."""
        first, *others = self.routings
        causal = evaluate(engine, self.batches, first, micro_batch)
        losses = {"validation_loss": causal.loss, "validation_loss_se": causal.se}
        for routing in others:
            other = evaluate(engine, self.batches, routing, micro_batch)
            losses.update({f"validation_loss_{routing}_routing": other.loss,
                           f"validation_loss_{routing}_routing_se": other.se,
                           f"validation_{first}_routed_share": causal.routed_share})
        self.latest = (step, losses)
        return losses

    def result_at(self, engine, step: int, micro_batch: int | None = None) -> dict:
        """The validation of the weights at `step`, the run's last: the one the loop ran there, or a new one (a
        run that resumed at its last step trains no step)."""
        if self.latest is not None and self.latest[0] == step:
            return self.latest[1]
        return self.run(engine, step, micro_batch)
