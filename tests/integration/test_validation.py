"""Validation loss and its standard error, against a naive per-sequence computation."""

import math

import deepspeed
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.common import tiny_config

from adaptive_ds import distributed
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.training.validation import evaluate


def _engine(arch):
    distributed.init_distributed()
    model = AdaptiveDSForCausalLM(tiny_config(arch))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
              "torch_adam": True}}, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@pytest.mark.parametrize("arch", ["dense", "mod"])
def test_validation_loss_and_standard_error_match_a_naive_per_sequence_computation(arch):
    engine = _engine(arch)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        ids = torch.randint(2, 64, (2, 16), generator=gen)
        labels = ids.clone()
        labels[:, 10 + len(batches):] = -100  # unequal target counts per batch
        batches.append({"input_ids": ids, "labels": labels})
    loss, se, share = evaluate(engine, batches)
    # in forwards of one row (the micro-batch an out-of-memory halving leaves), the same figures
    chunked = evaluate(engine, batches, micro_batch=1)
    assert chunked[:2] == pytest.approx((loss, se), rel=1e-6)
    assert chunked.routed_share == (None if share is None else pytest.approx(share, rel=1e-6))
    # naive: each sequence alone, the model in eval mode, token losses summed by hand
    model = engine.module.eval()
    sums, counts = [], []
    with torch.no_grad():
        for batch in batches:
            for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
                logits = model(input_ids=ids[None]).logits[0]
                keep = labels[1:] != -100
                sums.append(F.cross_entropy(logits[:-1][keep], labels[1:][keep], reduction="sum").item())
                counts.append(int(keep.sum()))
    s, n = np.array(sums), np.array(counts)
    ratio = s.sum() / n.sum()
    assert loss == pytest.approx(ratio, rel=1e-5)
    # the ratio estimator's standard error over the 6 sequences
    expected = math.sqrt(((s - ratio * n) ** 2).sum() / (len(s) * (len(s) - 1))) / n.mean()
    assert se == pytest.approx(expected, rel=1e-4) and 0 < se < loss
    if arch == "dense":
        assert share is None
        return
    # the causal routed share, counted by hand from the router logits (a token runs a block when its logit > 0)
    hooks = [m.router.register_forward_hook(lambda _, __, out: routed_counts.append(out.squeeze(-1) > 0))
             for m in model.modules() if hasattr(m, "router") and hasattr(m, "capacity")]
    routed_counts: list[torch.Tensor] = []
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch["input_ids"])
    for hook in hooks:
        hook.remove()
    routed, passes = sum(int(r.sum()) for r in routed_counts), sum(r.numel() for r in routed_counts)
    assert share == pytest.approx(routed / passes) and 0 < share < 1
