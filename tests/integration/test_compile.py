"""`--compile` traces the dense and MoD training step as one graph: no graph breaks (each would split the step
into separately compiled pieces with eager Python between them); RoPE's cos and sin are a constant of the graph,
with eager's values; the loss reads the logits whole (the labels shift, not the logits), with eager's value."""

import copy

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


def _graph_ops(model, **inputs) -> tuple[set[str], torch.Tensor]:
    """The names of the ops in the graph dynamo traces of `model`'s forward, and the logits it computes (traced and
    run by the eager backend: the same kernels as eager, so where the graph computes what eager does, bit for bit)."""
    torch._dynamo.reset()
    names = set()

    def backend(gm, example_inputs):
        names.update(node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
                     for node in gm.graph.nodes if node.op in ("call_function", "call_method"))
        return gm.forward

    with torch.no_grad():
        logits = torch.compile(model, backend=backend)(**inputs).logits
    return names, logits


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "dynamic", "factor": 3.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_compiled_rope_is_a_constant_of_the_graph_with_eagers_values(scaling):
    """Compiled, RoPE's cos and sin are a table the graph holds (computed in the graph, inductor would inline them
    into every kernel that rotates q and k and compute them again per element, forward and backward); sliced at
    the forward's positions, the table holds the values eager computes, so the logits are eager's bit for bit, at
    the start of a sequence and past a cached prefix."""
    torch.manual_seed(0)
    model = AdaptiveDSForCausalLM(tiny_config("dense", rope_scaling_parameters=scaling)).eval()
    ids = torch.randint(2, 64, (2, 24))
    names, logits = _graph_ops(model, input_ids=ids, use_cache=False)
    assert not names & {"cos", "sin"}, sorted(names)
    with torch.no_grad():
        assert torch.equal(logits, model(input_ids=ids, use_cache=False).logits)
        prefix = model(input_ids=ids[:, :16], use_cache=True).cache
        expected = model(input_ids=ids[:, 16:], cache=copy.deepcopy(prefix)).logits
    names, logits = _graph_ops(model, input_ids=ids[:, 16:], cache=copy.deepcopy(prefix))
    assert not names & {"cos", "sin"}, sorted(names)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("num_items", [None, 29.0])
def test_compiled_loss_reads_the_logits_whole_and_equals_eagers(num_items):
    """Compiled, the cross entropy takes every position's logits (batch x seq rows; the last position's target is
    ignored) rather than a slice of them, a copy of nearly all the logits forward and backward; with skip_logits the
    logits are not among the graph's outputs; the loss is eager's (the same targets, summed in another order)."""
    torch.manual_seed(0)
    model = AdaptiveDSForCausalLM(tiny_config("dense"))
    ids = torch.randint(2, 64, (2, 24))
    labels = ids.clone()
    labels[1, :7] = -100
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    rows, outputs = [], []

    def backend(gm, example_inputs):
        rows.extend(node.args[0].meta["example_value"].shape[0] for node in gm.graph.nodes
                    if node.op == "call_function" and getattr(node.target, "__name__", "") == "cross_entropy")
        outputs.extend(tuple(value.meta["example_value"].shape) for node in gm.graph.nodes if node.op == "output"
                       for value in torch.utils._pytree.tree_leaves(node.args) if isinstance(value, torch.fx.Node))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)(input_ids=ids, labels=labels, skip_logits=True, **extra)
    assert rows == [2 * 24]
    # with skip_logits the logits are no output of the graph (its backward would take a gradient for them)
    assert compiled.logits is None and (2, 24, 64) not in outputs and outputs, outputs
    eager = model(input_ids=ids, labels=labels, **extra)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-6, atol=0)
