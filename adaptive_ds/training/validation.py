"""Validation: held-out loss on the same batches every time, at its own cadence."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import distributed


@torch.no_grad()
def evaluate(engine, batches: list[dict], mod_routing: str = "causal") -> float:
    """Mean LM loss per target token over held-out batches (the model in eval mode), over all ranks' batches.

    MoD blocks route with `mod_routing`: "causal" (the predictor; what generation does, the honest figure) or
    "topk" (the train-time rule, which sees the whole sequence).
    """
    model = engine.module.model
    engine.eval()
    model.set_mod_routing(mod_routing)
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # (summed token loss, target tokens)
    for batch in batches:
        batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
        targets = (batch["labels"][:, 1:] != -100).sum()
        out = engine(**batch, num_items_in_batch=1)  # summed, not averaged, over the batch's targets
        total += torch.stack([out.lm_loss.double(), targets.double()])
    model.set_mod_routing("causal")
    engine.train()
    if distributed.world_size() > 1:
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


class Validator:
    """Owns the held-out batches and the cadence (`eval_steps`; 0: only at the end)."""

    def __init__(self, batches: list[dict], eval_steps: int, uses_mod: bool):
        self.batches, self.eval_steps, self.uses_mod = batches, eval_steps, uses_mod

    def should_run(self, step: int) -> bool:
        return bool(self.eval_steps) and step % self.eval_steps == 0

    def run(self, engine) -> dict:
        losses = {"validation_loss": evaluate(engine, self.batches)}
        if self.uses_mod:
            losses["validation_loss_topk_routing"] = evaluate(engine, self.batches, "topk")
        return losses
