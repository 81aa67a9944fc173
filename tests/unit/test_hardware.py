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
    assert DEVICES["cpu"].memory_gib is None and DEVICES["cpu"].host_memory_gib is None
    assert DEVICES["a100_40gb"].memory_gib < DEVICES["a100"].memory_gib


@pytest.mark.parametrize("key, instance_gib, instance_gpus", [
    # AWS EC2 instance types: g4dn.xlarge 1 T4 and 16 GiB; p4d / p4de.24xlarge 8 A100 and 1,152 GiB; p5 / p5e.48xlarge
    # 8 H100 / H200 and 2,048 GiB
    ("t4", 16, 1), ("a100", 1152, 8), ("a100_40gb", 1152, 8), ("h100", 2048, 8), ("h200", 2048, 8),
])
def test_host_memory_is_the_usual_instances_ram_per_gpu(key, instance_gib, instance_gpus):
    device = DEVICES[key]
    assert device.host_memory_gib == instance_gib / instance_gpus
    assert f"{instance_gpus} GPU" in device.host_instance and f"{instance_gib:,} GiB" in device.host_instance


@pytest.mark.parametrize("cuda_name, key", [
    ("Tesla T4", "t4"), ("NVIDIA A100-SXM4-40GB", "a100_40gb"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA L4", None),  # a GPU the table does not know: no peak, no price
])
def test_a_cuda_device_is_detected_by_its_name(monkeypatch, cuda_name, key):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: cuda_name)
    assert detect_device() == key


def test_without_cuda_the_device_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")  # not asked without CUDA
    assert detect_device() == "cpu"


@pytest.mark.gpu
def test_the_gpu_this_runs_on_is_in_the_table():
    assert detect_device() in GPUS, torch.cuda.get_device_name()
