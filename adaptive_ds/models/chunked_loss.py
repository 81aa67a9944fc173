"""The output projection and the cross entropy in one pass over chunks of tokens: the logits never exist whole.

`linear_cross_entropy(hidden, weight, targets)` is `F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)`
(or its sum over a given count) computed a chunk of rows at a time. When a gradient is wanted, each chunk's gradient
(the softmax less the one-hot target, scaled) is taken at once, multiplied back into the hidden states' and the
weight's gradients, and dropped: the forward keeps those two gradients instead of a (tokens x vocabulary) logits tensor,
and the backward only scales them by the incoming gradient, which is exact because the loss is a scalar. The same
matmuls as projecting, then differentiating the loss (one forward, two backward), and no more; what goes is the
logits, the largest activation of a step at a large vocabulary, and their gradient.

The compiled model uses it (`AdaptiveDSForCausalLM.forward` under torch.compile with `skip_logits`); eager keeps
`F.cross_entropy` over the whole logits, whose reduction order the golden losses hold.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
# Logits per chunk: a block of float32 logits of this many elements, 125 MiB (1,024 rows at a 32,000-token
# vocabulary; b1's logits for a micro-batch of 4 x 2,048 tokens are 1 GiB in float32, and their gradient as much
# again): a memory measure, so a chunk has fewer rows at a larger vocabulary (215 at Qwen's 151,936) and more at a
# smaller one; where the logits are smaller than a chunk (the debug preset's 4,096 x 128) they are one chunk, with no
# loop's extra kernels. The loop is unrolled when the graph is traced, so each micro-batch shape compiles its own
# graph (as a changed shape recompiles any compiled step).
CHUNK_ELEMENTS = 1024 * 32_000


def chunk_rows_for(vocab_size: int) -> int:
    """Rows per chunk at `vocab_size`: as many as fit CHUNK_ELEMENTS logits, at least one."""
    return max(1, CHUNK_ELEMENTS // vocab_size)

class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, denominator, chunk_rows: int, hidden_grad: bool, weight_grad: bool):
        loss = hidden.new_zeros((), dtype=torch.float32)
        # The gradients before the division by the denominator and the incoming gradient (the loss scale, under fp16),
        # which backward applies in float32: divided here, in fp16, (softmax - one_hot) / 8,000 targets would fall
        # below fp16's range before the loss scale could lift it.
        grad_hidden = torch.empty_like(hidden) if hidden_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start:start + chunk_rows]
            t = targets[start:start + chunk_rows]
            logits = (h @ weight.t()).float()
            valid = t != IGNORE_INDEX
            target = torch.where(valid, t, 0).unsqueeze(1)
            log_norm = torch.logsumexp(logits, dim=1, keepdim=True)
            loss = loss + torch.where(valid, (log_norm - logits.gather(1, target)).squeeze(1), 0.0).sum()
            if hidden_grad or weight_grad:
                # d(summed loss)/d(logits) = softmax - one_hot(target), on the rows with a target
                grad = torch.exp(logits - log_norm).scatter_add(1, target, torch.full_like(log_norm, -1.0))
                grad = torch.where(valid.unsqueeze(1), grad, 0.0).to(hidden.dtype)
                if hidden_grad:
                    grad_hidden[start:start + chunk_rows] = grad @ weight
                if weight_grad:
                    grad_weight += (grad.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight, denominator)
        ctx.weight_dtype = weight.dtype
        return loss / denominator

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, denominator = ctx.saved_tensors
        factor = grad_loss.float() / denominator
        if grad_hidden is not None:
            grad_hidden = (grad_hidden.float() * factor).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * factor).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         num_items: torch.Tensor | int | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """The mean cross entropy of `hidden @ weight.T` (rows x vocabulary logits, in float32) against `targets`, over the
    rows whose target is not -100; with `num_items`, the summed loss over that count instead (transformers'
    `num_items_in_batch`). `hidden`: (rows, hidden); `weight`: (vocabulary, hidden); `targets`: (rows,);
    `chunk_rows`: rows per chunk (default: `chunk_rows_for` the vocabulary).

    As `F.cross_entropy(...)` does, a batch with no target gives nan for the mean (0 / 0)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and "
                         f"targets {tuple(targets.shape)} do not fit (rows x hidden, vocabulary x hidden, rows)")
    if num_items is None:
        denominator = (targets != IGNORE_INDEX).sum().float()
    else:
        denominator = torch.as_tensor(num_items, device=hidden.device).float()
    grad = torch.is_grad_enabled()
    rows = chunk_rows or chunk_rows_for(weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, denominator, rows, grad and hidden.requires_grad,
                                     grad and weight.requires_grad)
