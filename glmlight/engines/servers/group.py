"""weight_sync=distributed: the trainer's side of the weight-update process group a transport builds with
its servers (trainer = rank 0, each server's ranks from its rank offset), and the broadcast of one bucket.
The servers' side (their join and receive requests) is each transport's own (vllm/sync.py, sglang/sync.py);
a server that restarted lost its group, so a re-sync builds it again under a new name (`renew`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from glmlight.engines import transport as wt
from glmlight.engines.servers.launch import free_port, local_ip_towards


class UpdateGroup:
    """See the module docstring."""

    def __init__(self, backend: str = "nccl", master_address: str | None = None):
        self.backend, self.master_address = backend, master_address
        self.name = f"glmlight-{os.urandom(6).hex()}"
        self.group = None

    def plan(self, urls: Sequence[str], sizes: Sequence[int]) -> tuple[str, int, int, list[int]]:
        """(address, port, world size, each server's rank offset) for servers of `sizes` ranks each."""
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        return self.master_address or local_ip_towards(urls[0]), free_port(""), world, offsets

    def join(self, address: str, port: int, world: int, timeout_s: float) -> None:
        """Join as rank 0 (the servers join at the same time)."""
        self.group = wt.init_custom_process_group(self.backend, f"tcp://{address}:{port}", world, 0, self.name,
                                                  timeout_s=timeout_s)

    def broadcast(self, bucket: list) -> None:
        device = wt.sync_device(self.backend)
        for _, t in bucket:
            torch.distributed.broadcast(t.detach().to(device).contiguous(), src=0, group=self.group)

    def destroy(self) -> None:
        """Leave the group, if joined (closing must not fail)."""
        if self.group is not None:
            try:
                torch.distributed.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - closing must not fail
                pass
            self.group = None

    def renew(self) -> None:
        """Leave the group; the next one gets a new name."""
        self.destroy()
        self.name = f"glmlight-{os.urandom(6).hex()}"
