"""The hardware table: every GPU has the facts the planner and MFU need, and CUDA names map to the right row."""

import pytest
import torch

from adaptive_ds.hardware import DEVICES, GPUS, detect_device, gpu_key


@pytest.mark.parametrize("cuda_name, key", [
    ("Tesla T4", "t4"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100_40gb"),  # the more specific row, with its own memory and price
    ("NVIDIA A100-PCIE-40GB", "a100_40gb"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA L4", None),
])
def test_cuda_names_find_their_row(cuda_name, key):
    assert gpu_key(cuda_name) == key


def test_every_gpu_has_a_peak_and_a_memory_and_the_cpu_has_neither():
    assert set(GPUS) == set(DEVICES) - {"cpu"}
    assert all(DEVICES[g].peak_tflops > 0 and DEVICES[g].memory_gib > 0 for g in GPUS)
    assert DEVICES["cpu"].peak_tflops is None and DEVICES["cpu"].price_per_hour > 0
    assert DEVICES["a100_40gb"].memory_gib < DEVICES["a100"].memory_gib


def test_this_machine_is_detected():
    if torch.cuda.is_available():
        assert detect_device() == gpu_key(torch.cuda.get_device_name())
    else:
        assert detect_device() == "cpu"


@pytest.mark.gpu
def test_the_gpu_this_runs_on_is_in_the_table():
    assert detect_device() in GPUS, torch.cuda.get_device_name()
