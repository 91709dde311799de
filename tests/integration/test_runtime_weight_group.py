"""The weight-update process group (tether.runtime.weight_group) between two real processes:
a broadcast from rank 0 (also as a trainer rank under torchrun) reaches the peer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tether.runtime.errors import ConfigError
from tether.runtime.weight_group import broadcast, destroy_weight_group, init_weight_group


@pytest.mark.parametrize("under_torchrun", [False, True])
def test_weight_group_broadcast_between_processes(
    under_torchrun: bool, monkeypatch: pytest.MonkeyPatch, free_port: int
) -> None:
    if under_torchrun:
        # A trainer rank under torchrun: rank 0 must still host the group's store.
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    port = free_port
    peer = (
        "import torch;"
        "from tether.runtime.weight_group import init_weight_group, broadcast, destroy_weight_group;"
        f"g = init_weight_group('tcp://127.0.0.1:{port}', 1, 2, 'unit-group');"
        "t = torch.zeros(4); broadcast(t, 0, g); print(t.tolist()); destroy_weight_group(g)"
    )
    proc = subprocess.Popen([sys.executable, "-c", peer], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        group = init_weight_group(f"tcp://127.0.0.1:{port}", 0, 2, "unit-group")
        broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0]), 0, group)
        out, err = proc.communicate(timeout=60)
        destroy_weight_group(group)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip().splitlines()[-1] == "[1.0, 2.0, 3.0, 4.0]"
    with pytest.raises(ConfigError, match="init_method"):
        init_weight_group("http://x", 0, 1, "g")
