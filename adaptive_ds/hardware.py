"""The one table of hardware facts: peak dense tensor throughput (MFU, the honesty bound on tokens/s), the
memory the planner fits a model into, the host RAM an offloaded optimizer must fit into, and the rental price
behind every cost figure."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Device:
    peak_tflops: float | None  # dense fp16/bf16 tensor-core peak, TFLOP/s (vendor datasheet, without sparsity)
    memory_gib: float | None  # what the planner may fill (a T4's 16 GB card shows 15 GiB to CUDA)
    price_per_hour: float | None  # on-demand $ per device-hour; None: no price known (pass --price)
    names: tuple[str, ...] = ()  # all appear in its CUDA device name (lower case, spaces removed)
    # CPU RAM per GPU of the usual cloud instance with this GPU (its RAM / its GPUs), where ZeRO-Offload keeps the
    # optimizer states; None: no usual instance (consumer cards; the CPU row, which has no GPU figures).
    host_memory_gib: float | None = None
    host_instance: str | None = None  # that instance, as its provider names it


# Prices: rounded cloud list prices, late 2026 (planner and grid take --price to override). "cpu": a 2-vCPU x86
# cloud VM such as the machine the CPU figures come from; no peak is agreed for it, so it reports achieved
# TFLOP/s instead of MFU.
# Host RAM per GPU from AWS EC2's instance types: for the T4 its one-GPU instance, for the data-centre GPUs their
# 8-GPU instance (its RAM / 8); AWS offers no RTX 3090 or 4090, so those have none.
DEVICES: dict[str, Device] = {
    "cpu": Device(None, None, 0.09),
    "t4": Device(65.0, 15.0, 0.35, ("t4",), 16.0, "AWS g4dn.xlarge (1 GPU, 16 GiB)"),
    "rtx3090": Device(71.0, 24.0, None, ("rtx3090",)),
    "rtx4090": Device(165.0, 24.0, 0.69, ("rtx4090",)),
    "a100": Device(312.0, 80.0, 1.79, ("a100",), 1152 / 8, "AWS p4de.24xlarge (8 GPUs, 1,152 GiB)"),
    "a100_40gb": Device(312.0, 40.0, 1.29, ("a100", "40gb"), 1152 / 8, "AWS p4d.24xlarge (8 GPUs, 1,152 GiB)"),
    "h100": Device(989.0, 80.0, 2.99, ("h100",), 2048 / 8, "AWS p5.48xlarge (8 GPUs, 2,048 GiB)"),
    "h200": Device(989.0, 141.0, 3.79, ("h200",), 2048 / 8, "AWS p5e.48xlarge (8 GPUs, 2,048 GiB)"),
}
GPUS = tuple(key for key, device in DEVICES.items() if device.peak_tflops is not None)


def gpu_key(cuda_name: str) -> str | None:
    """The DEVICES key of a CUDA device name such as "NVIDIA A100-SXM4-40GB" (the most specific match), or None
    for a GPU not in the table."""
    name = cuda_name.lower().replace(" ", "")
    matches = [key for key in GPUS if all(part in name for part in DEVICES[key].names)]
    return max(matches, key=lambda key: len(DEVICES[key].names), default=None)


def detect_device() -> str | None:
    """The DEVICES key of this process's device: "cpu" without CUDA, None for a GPU the table does not know."""
    if not torch.cuda.is_available():
        return "cpu"
    return gpu_key(torch.cuda.get_device_name())
