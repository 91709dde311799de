"""This machine's own GPUs, as inventory discovery reads them (running nvidia-smi, and NVML)."""

from __future__ import annotations

import pytest

from tether.placement.inventory import read_gpus_nvidia_smi, read_gpus_nvml, read_local_gpus


def test_this_cpu_machine_has_no_gpus() -> None:
    assert read_local_gpus() == []


@pytest.mark.gpu
@pytest.mark.skipif(not read_gpus_nvml(), reason="needs a GPU visible to NVML")
def test_nvml_and_nvidia_smi_agree_on_a_gpu_machine() -> None:
    assert read_gpus_nvml() == read_gpus_nvidia_smi()
