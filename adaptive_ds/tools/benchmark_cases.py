"""The benchmark's cases (tools/benchmark.py): what each builds, and the ratios it reports."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.modeling_outputs import CausalLMOutput

from ..presets import VARIANTS


class CaseSpec(NamedTuple):
    description: str  # as BENCHMARKS.md names the case
    model: dict  # model_config overrides: the architecture and anything else that differs


CASES = {
    "dense": CaseSpec("dense (ours)", {"arch": "dense"}),
    "dense_compile": CaseSpec("dense (ours) under torch.compile", {"arch": "dense"}),
    "hf_llama": CaseSpec("transformers LlamaForCausalLM, same weights", {"arch": "dense"}),
    # the strongest dense baseline
    "hf_llama_compile": CaseSpec("transformers LlamaForCausalLM under torch.compile", {"arch": "dense"}),
    # the same, called as ours is: only the loss leaves the compiled module, so the two compiled models compare under
    # the same call
    "hf_llama_loss_compile": CaseSpec("transformers LlamaForCausalLM under torch.compile, returning only its loss",
                                      {"arch": "dense"}),
    "moe": CaseSpec("moe (index-based dispatch)", {"arch": "moe"}),
    "moe_deepspeed": CaseSpec("moe with DeepSpeed's stock dispatch, same model and routing",
                              {"arch": "moe", "moe_dispatch": "deepspeed"}),
    "hf_mixtral": CaseSpec("transformers MixtralForCausalLM, same weights, dropless top-2", {"arch": "moe"}),
    # Capacity 0.5 in every block, explicitly (mod ships with the paper's setting, the variant `mod:paper`), and the
    # hybrid's MoE blocks top-2 like the `moe` case's (it ships top-1; every case here runs dropless): what the GPU
    # targets "mod (capacity 0.5) >= 1.6x dense" and "hybrid >= 1.4x moe" are stated for.
    "mod": CaseSpec("mod (capacity 0.5, every block)", {"arch": "mod", **VARIANTS["mod:half"].model}),
    "hybrid": CaseSpec("hybrid (MoD 0.5 in every block, around top-2 MoE)",
                       {"arch": "hybrid", **VARIANTS["mod:half"].model, "num_experts_per_tok": 2}),
    "mod_paper": CaseSpec("mod (capacity 0.125, every other block)", {"arch": "mod", **VARIANTS["mod:paper"].model}),
}
# our models: generate() needs no conversion, and --memory measures them beside the planner
GENERATION_CASES = ("dense", "moe", "mod", "mod_paper", "hybrid")
RATIOS = (("moe", "moe_deepspeed"), ("mod", "dense"), ("mod_paper", "dense"), ("hybrid", "moe"), ("dense", "hf_llama"),
          ("dense", "hf_llama_compile"), ("dense_compile", "hf_llama_compile"),
          ("dense_compile", "hf_llama_loss_compile"), ("dense_compile", "dense"),
          ("hf_llama_compile", "hf_llama"), ("moe", "hf_mixtral"))


class LossOnly(torch.nn.Module):
    """A causal LM whose forward returns its loss alone: transformers' Llama called as the trainer calls ours
    (`skip_logits=True`), so that compiled, its logits are not an output of the graph either."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs) -> CausalLMOutput:
        return CausalLMOutput(loss=self.model(**inputs).loss)
