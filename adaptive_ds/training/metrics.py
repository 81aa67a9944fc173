"""What a run measures: routing statistics, throughput, memory; and where it writes them (metrics.jsonl)."""

from __future__ import annotations

import copy
import json
import math
import resource
import sys

import torch

from ..flops import training_flops_per_token
from ..models.configuration import AdaptiveDSConfig


def load_balance(counts: torch.Tensor) -> float:
    """Normalised entropy of an expert load: H(counts / sum) / log(num_experts); 1.0 is perfectly even."""
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts.double() / total
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return entropy / math.log(len(counts))


class RoutingWindow:
    """Routing statistics of the micro-batches since the last log, from the model's outputs."""

    def __init__(self, config: AdaptiveDSConfig):
        self.config = config
        # FLOPs reduction is against the same model with every block run on every token.
        unrouted = copy.copy(config)
        unrouted.arch = "moe" if config.uses_moe else "dense"
        self._unrouted_flops = training_flops_per_token(unrouted, config.max_position_embeddings)
        self.reset()

    def reset(self) -> None:
        self.expert_counts: list[torch.Tensor] | None = None  # per MoE layer, (num_experts,)
        self.aux_losses: list[float] = []
        self.routed: list[int] | None = None  # per MoD block: tokens that ran the block
        self.offered = 0  # tokens offered to each MoD block

    def add(self, output, seq_tokens: int) -> None:
        if output.expert_counts is not None:
            counts = [c.detach().float().cpu() for c in output.expert_counts]
            self.expert_counts = counts if self.expert_counts is None else [
                a + b for a, b in zip(self.expert_counts, counts, strict=True)]
            self.aux_losses.append(output.aux_loss.item())
        if output.mod_selected is not None:
            routed = [s.numel() for s in output.mod_selected]
            self.routed = routed if self.routed is None else [a + b for a, b in zip(self.routed, routed, strict=True)]
            self.offered += seq_tokens

    def summary(self) -> dict:
        stats = {}
        if self.expert_counts is not None:
            per_layer = torch.stack(self.expert_counts)  # (moe layers, experts)
            stats["moe"] = {
                "tokens_per_expert": per_layer.sum(0).long().tolist(),
                "expert_utilisation": (per_layer > 0).float().mean().item(),
                "load_balance": sum(load_balance(c) for c in per_layer) / len(per_layer),
                "aux_loss": sum(self.aux_losses) / len(self.aux_losses),
            }
        if self.routed is not None and self.offered:
            fractions = [r / self.offered for r in self.routed]
            routed = training_flops_per_token(self.config, self.config.max_position_embeddings, fractions)
            stats["mod"] = {
                "skip_rate": 1.0 - sum(self.routed) / (self.offered * len(self.routed)),
                "flops_reduction": 1.0 - routed / self._unrouted_flops,
            }
        return stats


def peak_memory() -> dict:
    """Peak memory of this process: GPU allocator peak when on CUDA, else the resident-set high-water mark."""
    if torch.cuda.is_available():
        return {"device": "cuda", "peak_allocated_bytes": torch.cuda.max_memory_allocated()}
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"device": "cpu", "peak_rss_bytes": maxrss if sys.platform == "darwin" else maxrss * 1024}


class MetricsWriter:
    """Appends one JSON object per logged step to OUTPUT_DIR/metrics.jsonl (rank 0 only)."""

    def __init__(self, path: str | None):
        self._file = open(path, "a") if path else None

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
