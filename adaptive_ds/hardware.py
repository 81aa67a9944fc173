"""Peak dense tensor throughput and rental prices of common accelerators: MFU, the honesty bound on tokens/s,
and the cost figures."""

from __future__ import annotations

import torch

# Dense fp16/bf16 tensor-core peaks in TFLOP/s (vendor datasheets, without sparsity).
PEAK_TFLOPS = {"t4": 65.0, "rtx3090": 71.0, "rtx4090": 165.0, "a100": 312.0, "h100": 989.0, "h200": 989.0}

# On-demand $ per device-hour behind every cost figure (rounded cloud list prices, late 2026; planner and grid
# take --price to override). "cpu": a 2-vCPU x86 cloud VM such as the machine the CPU figures come from.
PRICE_PER_HOUR = {"cpu": 0.09, "t4": 0.35, "rtx4090": 0.69, "a100": 1.79, "a100_40gb": 1.29, "h100": 2.99,
                  "h200": 3.79}


def detect_gpu() -> str | None:
    """The key of PEAK_TFLOPS for the current CUDA device, or None (CPU, or a GPU not in the table)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower().replace(" ", "")
    return next((key for key in PEAK_TFLOPS if key in name), None)
