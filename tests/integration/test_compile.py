"""`--compile` traces the dense and MoD training step as one graph: no graph breaks (each would split the step
into separately compiled pieces with eager Python between them); RoPE's cos and sin are a constant of the graph,
with eager's values; the loss reads the logits whole (the labels shift, not the logits), or, without logits to
return, never holds them whole, with eager's value."""

import copy

import deepspeed
import pytest
import torch
from helpers.common import tiny_config

from adaptive_ds import distributed
from adaptive_ds.models import AdaptiveDSForCausalLM, chunked_loss
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
        out = engine(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(31.0), skip_logits=True)  # as trained
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


def _traced(model, **inputs):
    """Trace `model`'s forward with dynamo (eager backend, one graph: a graph break fails): its output, the row counts
    of the cross entropies the graph calls, and the shapes of every tensor the graph or a subgraph of it (an
    autograd.Function's) computes or returns."""
    rows, shapes = [], set()

    def backend(gm, example_inputs):
        graphs = [module.graph for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]
        for node in (node for graph in graphs for node in graph.nodes):
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "cross_entropy":
                rows.append(node.args[0].meta["example_value"].shape[0])
            values = node.args if node.op == "output" else [node]
            shapes.update(tuple(value.meta["example_value"].shape) for value in torch.utils._pytree.tree_leaves(values)
                          if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("example_value"),
                                                                             torch.Tensor))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True)(**inputs), rows, shapes


def _batch():
    torch.manual_seed(0)
    ids = torch.randint(2, 64, (2, 24))
    labels = ids.clone()
    labels[1, :7] = -100
    return ids, labels


@pytest.mark.parametrize("num_items", [None, 29.0])
def test_compiled_loss_with_its_logits_reads_them_whole_and_equals_eagers(num_items):
    """Asked for the logits too, the compiled cross entropy takes every position's logits (batch x seq rows; the last
    position's target is ignored) rather than a slice of them, a copy of nearly all the logits forward and backward;
    the loss is eager's (the same targets, summed in another order)."""
    ids, labels = _batch()
    model = AdaptiveDSForCausalLM(tiny_config("dense"))
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    compiled, rows, shapes = _traced(model, input_ids=ids, labels=labels, **extra)
    assert rows == [2 * 24] and (2, 24, 64) in shapes
    eager = model(input_ids=ids, labels=labels, **extra)
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=0, atol=0)


@pytest.mark.parametrize(("num_items", "tied"), [(None, False), (29.0, False), (29.0, True)])
def test_compiled_loss_without_logits_never_holds_them_whole_and_trains_as_eager(num_items, tied, monkeypatch):
    """With skip_logits (as the trainer calls it), compiled: the output projection and the loss run a chunk of
    positions at a time (models/chunked_loss.py), so no tensor of the graph holds the whole logits; the loss and
    every parameter's gradient are eager's, to float32's rounding."""
    monkeypatch.setattr(chunked_loss, "CHUNK_ELEMENTS", 16 * 96)  # 16 rows a chunk
    ids, labels = _batch()
    # no other size of the model is 96; tied, the output projection's weight is the embedding's, both gradients in one
    model = AdaptiveDSForCausalLM(tiny_config("dense", vocab_size=96, tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    compiled, rows, shapes = _traced(model, input_ids=ids, labels=labels, skip_logits=True, **extra)
    assert compiled.logits is None and rows == []
    assert (2 * 24, 96) not in shapes and (2, 24, 96) not in shapes, shapes  # the whole logits, in either form
    assert (16, 96) in shapes  # a chunk's logits
    compiled.loss.backward()
    compiled_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    eager = model(input_ids=ids, labels=labels, **extra)
    eager.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(compiled_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_an_output_projection_it_cannot_multiply_by_keeps_the_stock_loss():
    """A weight ZeRO-3 partitioned (gathered only inside lm_head's own call), a projection with a bias, or an lm_head
    an adapter wrapped: the compiled loss projects through the module and takes the stock cross entropy."""
    ids, labels = _batch()
    model = AdaptiveDSForCausalLM(tiny_config("dense"))
    model.lm_head.weight.ds_id = 0  # as ZeRO-3 marks the parameters it partitions
    _, rows, _ = _traced(model, input_ids=ids, labels=labels, skip_logits=True)
    assert rows == [2 * 24]
    del model.lm_head.weight.ds_id
    _, rows, _ = _traced(model, input_ids=ids, labels=labels, skip_logits=True)
    assert rows == []  # the plain projection takes the chunked loss
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(64))
    _, rows, _ = _traced(model, input_ids=ids, labels=labels, skip_logits=True)
    assert rows == [2 * 24]
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False))
    _, rows, _ = _traced(model, input_ids=ids, labels=labels, skip_logits=True)
    assert rows == [2 * 24]
