"""`--compile` traces the dense and MoD training step as one graph: no graph breaks (each would split the step
into separately compiled pieces with eager Python between them)."""

import deepspeed
import pytest
import torch
from helpers.common import tiny_config

from adaptive_ds import distributed
from adaptive_ds.models import AdaptiveDSForCausalLM
from adaptive_ds.training import moe_adapter
from adaptive_ds.training.optim import parameter_groups


def _compiled_steps(arch: str, steps: int, checkpointing: bool = False) -> dict:
    """Train `steps` steps through a DeepSpeed engine compiled as `--compile` does (`engine.compile()`), with the
    eager backend (dynamo's tracing, which is what breaks graphs, without inductor's code generation)."""
    distributed.init_distributed()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = AdaptiveDSForCausalLM(tiny_config(arch))
    model.model.gradient_checkpointing = checkpointing
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    moe_adapter.prepare(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.1), config=config)
    engine.compile(backend="eager")
    for _ in range(steps):
        ids = torch.randint(2, 64, (2, 32))
        out = engine(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(31.0))
        engine.backward(out.loss)
        engine.step()
    counters = torch._dynamo.utils.counters
    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "loss": out.loss.item()}


@pytest.mark.parametrize("arch", ["dense", "mod"])
def test_compiled_step_has_no_graph_breaks(arch):
    counts = _compiled_steps(arch, steps=3)
    assert counts["graph_breaks"] == 0, torch._dynamo.utils.counters["graph_break"]
    assert counts["graphs"] == 1  # one graph, compiled once: no recompilation across steps
    assert torch.isfinite(torch.tensor(counts["loss"]))
