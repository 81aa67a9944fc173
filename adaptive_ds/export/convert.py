"""Export a training checkpoint as a Hugging Face folder, or convert a model to stock transformers classes.

    python -m adaptive_ds.export CHECKPOINT OUT_DIR                 # adaptive_ds model (safetensors)
    python -m adaptive_ds.export --to llama SRC OUT_DIR             # dense (or retrofitted MoD, capacity 1) -> Llama
    python -m adaptive_ds.export --to mixtral SRC OUT_DIR           # dropless top-2 MoE -> MixtralForCausalLM

CHECKPOINT is a run's OUTPUT_DIR (its latest checkpoint), OUTPUT_DIR/checkpoints, or one checkpoint tag
directory. DeepSpeed's files are consolidated: the module states (full under ZeRO-1/2; under ZeRO-3 the fp32
partitions of every rank, through DeepSpeed's zero_to_fp32) and the one file per expert that DeepSpeed's MoE
checkpoint layout writes from every expert-parallel rank. Weights are exported in the precision the module
trained in (fp32 from ZeRO-3). SRC for a conversion is a checkpoint or a `save_pretrained` folder.

Checkpoints are read by `adaptive_ds.ds_checkpoint` (no training code; DeepSpeed only for ZeRO-3's partitions).
The adaptive_ds folder also carries the model's source files and an `auto_map` (`export.final.save_with_code`,
as `final/` does), so users with torch and transformers alone (no deepspeed, no adaptive_ds) load it with
`trust_remote_code=True`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from ..ds_checkpoint import CheckpointError, load_checkpoint
from ..models import AdaptiveDSConfig, AdaptiveDSForCausalLM
from .final import save_with_code

logger = logging.getLogger(__name__)


def load_any(path: str):
    """A checkpoint (`ds_checkpoint.load_checkpoint`) or a save_pretrained folder of an adaptive_ds model."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return AdaptiveDSForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return load_checkpoint(path)


def _common_llama_fields(config: AdaptiveDSConfig) -> dict:
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
                eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)


def llama_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model cannot be a stock Llama, or None if it can: a dense model is one parameter for parameter; a MoD
    model with the straight-through update scale (`mod_straight_through`: a dense model retrofitted with MoD) at
    `mod_capacity` 1.0 is one, its routers dropped: every token runs every block, scaled by exactly 1, as in its
    training. Below capacity 1.0 the Llama would compute a function the model never trained (its blocks saw only
    the routed share of the tokens), so it is refused."""
    if config.arch == "dense":
        return None
    if config.arch != "mod":
        return f"arch is {config.arch!r}: MoE layers have no Llama equivalent (--to mixtral exports MoE)"
    if not config.mod_straight_through:
        return ("its MoD blocks scale their update by sigmoid(router logit), which a Llama has no place for "
                "(a model retrofitted with MoD, mod_straight_through, at mod_capacity 1.0 exports as a Llama)")
    if config.mod_capacity != 1.0:
        return (f"it trained at mod_capacity {config.mod_capacity}, and a Llama runs every token through every "
                "block, which is its function only at mod_capacity 1.0")
    return None


def to_llama(model: AdaptiveDSForCausalLM) -> LlamaForCausalLM:
    """A stock LlamaForCausalLM with the same logits: our dense blocks are Llama's, parameter for parameter (a
    retrofitted MoD model at capacity 1.0: its logits, every token through every block; see
    `llama_incompatibility`)."""
    reason = llama_incompatibility(model.config)
    if reason:
        raise ValueError(f"--to llama needs a dense model (or a dense model retrofitted with MoD at capacity 1.0); "
                         f"this one: {reason}")
    llama = LlamaForCausalLM(LlamaConfig(**_common_llama_fields(model.config)))
    # a MoD block wraps the dense block as `block`, beside its router (and causal-routing predictor)
    state = {re.sub(r"^(model\.layers\.\d+\.)block\.", r"\1", name): tensor
             for name, tensor in model.state_dict().items() if not re.search(r"\.(router|predictor)\.", name)}
    llama.load_state_dict(state, strict=True)
    return llama.to(model.dtype)


def mixtral_incompatibility(config: AdaptiveDSConfig) -> str | None:
    """Why a model's routing cannot be expressed as Mixtral's, or None if it can.

    Mixtral routes every token to its top-k experts with softmax weights renormalised over the k, and never
    drops a token. That is our inference routing exactly when the model is top-k MoE (k >= 2, or top-1 renormalised
    by moe_renormalize_top1; counting the fine-grained experts as Mixtral experts of their width) in every layer
    without DeepSpeed's residual MLP, shared experts or a routing bias. A capacity limit (`moe_drop_tokens`) does not
    matter: it applies in training only, and inference is dropless (see models/moe.py).
    """
    reasons = []
    if config.arch != "moe":
        reasons.append(f"arch is {config.arch!r}, not 'moe'")
    if config.num_routed_experts_per_tok == 1 and not config.moe_renormalize_top1:
        reasons.append("top-1 weights are raw gate probabilities, Mixtral renormalises over the top-k "
                       "(moe_renormalize_top1 does too)")
    if config.moe_layer_interval != 1:
        reasons.append("MoE is not in every layer")
    if config.moe_use_residual:
        reasons.append("the residual (PR-MoE) MLP has no Mixtral equivalent")
    if config.moe_shared_experts:
        reasons.append("shared experts have no Mixtral equivalent")
    if config.moe_balancing == "bias":
        reasons.append("the routing bias (moe_balancing 'bias') has no Mixtral equivalent")
    return "; ".join(reasons) or None


def to_mixtral(model: AdaptiveDSForCausalLM) -> MixtralForCausalLM:
    reason = mixtral_incompatibility(model.config)
    if reason:
        raise ValueError(f"--to mixtral: routing semantics differ: {reason}")
    config = model.config
    fields = {**_common_llama_fields(config), "intermediate_size": config.expert_intermediate_size}
    mixtral = MixtralForCausalLM(MixtralConfig(**fields, num_local_experts=config.num_routed_experts,
                                               num_experts_per_tok=config.num_routed_experts_per_tok))
    state = {}
    for name, tensor in model.state_dict().items():
        if ".mlp.moe." not in name:
            state[name] = tensor
    for i, layer in enumerate(model.model.layers):
        moe = layer.mlp.moe.deepspeed_moe
        experts = moe.experts.deepspeed_experts
        state[f"model.layers.{i}.mlp.gate.weight"] = moe.gate.wg.weight
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
        state[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([e.down_proj.weight for e in experts])
    mixtral.load_state_dict(state, strict=True)
    return mixtral.to(model.dtype)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description="Export a checkpoint, or convert to stock transformers classes.")
    p.add_argument("src", help="OUTPUT_DIR, a checkpoint directory, or a save_pretrained folder")
    p.add_argument("dst", help="new or empty output folder")
    p.add_argument("--to", choices=["adaptive_ds", "llama", "mixtral"], default="adaptive_ds")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if os.path.isdir(args.dst) and os.listdir(args.dst):
        sys.exit(f"error: {args.dst!r} already holds files; pass a new or empty output folder")
    try:
        model, tokenizer = load_any(args.src)
        if args.to == "adaptive_ds":
            save_with_code(model, tokenizer, args.dst)
        else:
            converted = to_llama(model) if args.to == "llama" else to_mixtral(model)
            converted.save_pretrained(args.dst, safe_serialization=True)
            tokenizer.save_pretrained(args.dst)
    except (CheckpointError, ValueError) as error:
        sys.exit(f"error: {error}")
    logger.info("wrote %s (%s)", args.dst, args.to)


if __name__ == "__main__":
    main()
