"""The experts' weights as one (experts, out, in) tensor for the grouped GEMM, without a copy per forward.

`stacked_weights` views the weights where they lie at a regular stride in one storage, and packs them into one
buffer once where each owns its storage (`pack`). Model code only, in torch alone: a plain model (inference,
`from_pretrained`, a user's loop) packs its own experts on its first forward. What a trainer must do before an
optimizer flattens the parameters (pack first, then turn the layer's `may_pack` off) is the training side's:
`adaptive_ds.training.moe_adapter.pack_for_optimizer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class _StackedView(torch.autograd.Function):
    """The (experts, out, in) view of equally shaped expert weights that lie `stride` elements apart in one storage:
    no copy. Backward hands each expert the gradient of its own slice, as `torch.stack`'s backward would."""

    @staticmethod
    def forward(ctx, stride: int, *weights):
        first = weights[0]
        return first.as_strided((len(weights), *first.shape), (stride, *first.stride()), first.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return None, *grad.unbind(0)


def regular_stride(weights: Sequence[torch.Tensor]) -> int | None:
    """Elements from one expert's weight to the next's when all lie in one storage at one stride, each contiguous
    and equally shaped, the stride 16-byte aligned as `torch._grouped_mm` needs on GPU; else None.

    Host-only (pointers and offsets, no device work), so it costs microseconds per forward.
    """
    first = weights[0]
    stride = weights[1].storage_offset() - first.storage_offset() if len(weights) > 1 else first.numel()
    if first.data_ptr() % 16 or (len(weights) > 1 and (stride < first.numel() or stride * first.element_size() % 16)):
        return None  # misaligned, overlapping or reversed
    storage = first.untyped_storage().data_ptr()
    for e, w in enumerate(weights):
        if (w.shape != first.shape or w.dtype != first.dtype or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != storage
                or w.storage_offset() != first.storage_offset() + e * stride):
            return None
    return stride


def _owns_its_storage(w: torch.Tensor) -> bool:
    """Whether `w` is alone in its storage, so in no optimizer's flat buffer: moving it cuts nothing off. ZeRO-3's
    partitioned parameters (marked `ds_id`; MoE runs refuse ZeRO-3) are never moved: it swaps their storage."""
    return (not hasattr(w, "ds_id") and w.storage_offset() == 0 and w.is_contiguous()
            and w.untyped_storage().nbytes() == w.numel() * w.element_size())


def stacked_weights(weights: Sequence[nn.Parameter], may_pack: bool = True) -> torch.Tensor:
    """The experts' (out, in) weights of one projection as one (experts, out, in) tensor for the grouped GEMM.

    A view, no copy, when they lie at a regular stride in one storage: optimizers that flatten each param group into
    one buffer in parameter order (DeepSpeed's ZeRO-1/2, bf16 and fp16 optimizers, which also point the parameters
    back into it after every step) leave a layer's experts' weights a fixed distance apart there. With `may_pack`,
    weights that each own their storage are packed once into such a buffer, then viewed: a plain module, a model
    after `.to()` or `from_pretrained` (generation). A trainer that builds such an optimizer packs the weights first
    and turns `may_pack` off (adaptive_ds's does, in `training.moe_adapter`): a weight alone in its param group sits
    alone in that optimizer's flat buffer, which looks the same as owning its storage, and moving it would cut it
    off from the buffer the optimizer updates. Otherwise, and under `torch.inference_mode` (whose tensors could not
    train later) or torch.compile (pointer checks are not traceable), the weights are copied by `torch.stack` on
    every call. Nothing is cached: the layout is checked on each call (host-only), so any later re-pointing of the
    parameters (DeepSpeed's flattening, `.to()`) is followed.
    """
    if torch.compiler.is_compiling():
        return torch.stack(list(weights))
    stride = regular_stride(weights)
    if stride is None and may_pack and pack(weights):
        stride = regular_stride(weights)
    if stride is None:
        return torch.stack(list(weights))
    return _StackedView.apply(stride, *weights)


@torch.no_grad()
def pack(weights: Sequence[nn.Parameter]) -> bool:
    """Move the weights into one (experts, out, in) buffer and re-point each Parameter's `.data` at its slice, where
    that is safe: each owns its storage, and no inference-mode tensor would be made. The Parameter objects stay, so
    an optimizer holding them (torch's, DeepSpeed's unflattened ones) updates the buffer in place. Returns whether
    it packed."""
    if torch.is_inference_mode_enabled() or not all(_owns_its_storage(w) for w in weights):
        return False
    buffer = torch.stack([w.detach() for w in weights])
    for w, slot in zip(weights, buffer, strict=True):
        w.data = slot
    return True
