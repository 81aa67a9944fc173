"""What an MoE model's construction commits to: its state_dict's names in order, each tensor's shape, dtype and the
sha256 of its bytes, and the random-number state left after it, under a fixed seed. tests/fixtures/moe_state_dict.json
holds them as the model built them before its MoE layer was split into router, dispatcher and experts; old
checkpoints, final/ folders and the golden losses rely on them staying so.

    python tests/helpers/moe_state_snapshot.py tests/fixtures/moe_state_dict.json
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from adaptive_ds.models import AdaptiveDSConfig, AdaptiveDSForCausalLM

# Every kind of tensor an MoE layer holds (PR-MoE residual MLP and coefficient, shared experts, the routing bias), a
# dense block between MoE blocks, and experts split over two processes (a model built for one rank of two).
CASES = {
    "moe": dict(arch="moe", moe_use_residual=True, moe_shared_experts=1, moe_balancing="bias", moe_layer_interval=2,
                num_hidden_layers=4),
    "moe_ep2": dict(arch="moe", moe_ep_size=2, moe_expert_granularity=2),
    "hybrid": dict(arch="hybrid", num_experts_per_tok=1, moe_renormalize_top1=True, mod_layer_interval=2),
}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
            mod_capacity=0.5)
SEED = 3


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def snapshot(case: str) -> dict:
    """The names (in order), shapes, dtypes and digests of the state_dict of `case`'s model built under SEED, and the
    digest of the random-number state after it."""
    torch.manual_seed(SEED)
    model = AdaptiveDSForCausalLM(AdaptiveDSConfig(**{**TINY, **CASES[case]}))
    tensors = [[name, list(t.shape), str(t.dtype), _digest(t)] for name, t in model.state_dict().items()]
    return {"tensors": tensors, "rng_after": _digest(torch.get_rng_state())}


def main(path: str) -> None:
    with open(path, "w") as f:
        json.dump({case: snapshot(case) for case in CASES}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
