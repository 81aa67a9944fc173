"""Peak dense tensor throughput of common accelerators, for MFU and the honesty bound on tokens/s."""

from __future__ import annotations

import torch

# Dense fp16/bf16 tensor-core peaks in TFLOP/s (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"t4": 65.0, "rtx3090": 71.0, "rtx4090": 165.0, "a100": 312.0, "h100": 989.0, "h200": 989.0}


def detect_gpu() -> str | None:
    """The key of PEAK_TFLOPS for the current CUDA device, or None (CPU, or a GPU not in the table)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower().replace(" ", "")
    return next((key for key in PEAK_TFLOPS if key in name), None)
