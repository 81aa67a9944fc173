"""The chunked output projection and cross entropy (models/chunked_loss.py) against the stock library: the loss and
both gradients of `F.cross_entropy(hidden @ weight.T, ...)` over the whole logits, whatever the chunking."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from adaptive_ds.models.chunked_loss import chunk_rows_for, linear_cross_entropy


def _reference(hidden, weight, targets, num_items):
    logits = hidden @ weight.t()
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if num_items is None:
        return F.cross_entropy(logits, targets, ignore_index=-100)
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / num_items


def _loss_and_grads(fn, hidden, weight, targets, num_items, scale=1.0):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = fn(hidden, weight, targets, num_items)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), width=st.integers(1, 12), vocab=st.integers(2, 40), chunk=st.integers(1, 80),
       ignored=st.floats(0.0, 0.9), counted=st.booleans(), scale=st.floats(0.1, 4.0), seed=st.integers(0, 2**16))
def test_loss_and_gradients_are_the_stock_cross_entropys(rows, width, vocab, chunk, ignored, counted, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[torch.rand(rows, generator=generator) < ignored] = -100
    targets[0] = 0  # at least one target: the mean over none is nan for both
    num_items = rows + 3 if counted else None
    expected = _loss_and_grads(_reference, hidden, weight, targets, num_items, scale)
    chunked = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=chunk), hidden, weight, targets,
                              num_items, scale)
    for got, want in zip(chunked, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_batch_without_targets_gives_the_stock_results():
    hidden, weight = torch.randn(5, 3), torch.randn(7, 3)
    targets = torch.full((5,), -100)
    assert torch.isnan(linear_cross_entropy(hidden, weight, targets)) and torch.isnan(_reference(hidden, weight,
                                                                                                  targets, None))
    _, grad_hidden, grad_weight = _loss_and_grads(linear_cross_entropy, hidden, weight, targets, 4)
    assert not grad_hidden.any() and not grad_weight.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_under_a_loss_scale_keeps_its_dtypes_and_the_exact_values(dtype):
    """As the engine runs it in fp16 or bf16: b1's vocabulary, a micro-batch's count of targets (the loss a sum over
    8,190) and a loss scale on the backward. The loss in float32, the gradients in the parameters' dtype, each within
    that dtype's rounding of the exact (float64) gradients of the same rounded inputs: the softmax terms divided by the
    count before the loss scale reaches them would fall below fp16's range."""
    torch.manual_seed(0)
    rows, width, vocab, count, scale = 64, 16, 32000, 8190, 1024.0
    hidden, weight = torch.randn(rows, width).to(dtype), (torch.randn(vocab, width) / 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,))
    loss, grad_hidden, grad_weight = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_rows=16), hidden,
                                                     weight, targets, count, scale)
    exact = _loss_and_grads(_reference, hidden.double(), weight.double(), targets, count, scale)
    assert loss.dtype == torch.float32 and grad_hidden.dtype == dtype and grad_weight.dtype == dtype
    torch.testing.assert_close(loss.double(), exact[0], rtol=1e-3, atol=0)
    for got, want in ((grad_hidden, exact[1]), (grad_weight, exact[2])):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2, dtype


@pytest.mark.parametrize(("grad_enabled", "trainable", "matmuls"), [
    (False, ("hidden", "weight"), 1),  # the projection alone
    (True, ("hidden",), 2),  # and the hidden states' gradient (a frozen output projection, as under an adapter)
    (True, ("weight",), 2),  # and the weight's
    (True, ("hidden", "weight"), 3),
])
def test_only_the_gradients_wanted_are_computed(grad_enabled, trainable, matmuls):
    """Counted in FLOPs (torch's own counter): the forward takes a gradient for each input that wants one, and none
    without grad mode; the loss is the same."""
    rows, width, vocab = 12, 4, 9
    hidden = torch.randn(rows, width, requires_grad="hidden" in trainable)
    weight = torch.randn(vocab, width, requires_grad="weight" in trainable)
    targets = torch.randint(0, vocab, (rows,))
    with torch.set_grad_enabled(grad_enabled), FlopCounterMode(display=False) as counter:
        loss = linear_cross_entropy(hidden, weight, targets, chunk_rows=5)
    assert counter.get_total_flops() == matmuls * 2 * rows * width * vocab
    assert loss.requires_grad == grad_enabled
    torch.testing.assert_close(loss.detach(), _reference(hidden, weight, targets, None).detach())


def test_shapes_that_do_not_fit_are_named():
    with pytest.raises(ValueError, match=r"hidden \(4, 3\), weight \(9, 5\) and targets \(4,\) do not fit"):
        linear_cross_entropy(torch.randn(4, 3), torch.randn(9, 5), torch.zeros(4, dtype=torch.long))


def test_a_chunk_holds_a_fixed_number_of_logits_whatever_the_vocabulary():
    """125 MiB of float32 logits a chunk: Llama's 32,000-token vocabulary 1,024 rows, Qwen's 151,936 215 rows, the
    embedded corpus's (104 tokens, padded to 128) a whole debug micro-batch of 16 x 256 in one chunk; a vocabulary
    past the budget still one row."""
    assert chunk_rows_for(32_000) == 1024
    rows = chunk_rows_for(151_936)
    assert rows == 215 and rows * 151_936 * 4 <= 125 * 2**20 < (rows + 1) * 151_936 * 4
    assert chunk_rows_for(128) >= 16 * 256
    assert chunk_rows_for(10**9) == 1
