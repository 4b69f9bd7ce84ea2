"""Data parallel training: rank and world from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), gloo on
CPU and nccl on CUDA, the sums and barriers the training loop needs (nothing when there is one process)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["Dist", "dist_setup"]


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device
    owned: bool  # this call initialised the process group (and destroys it)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.owned:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.owned = False


def dist_setup(device: str | None) -> Dist:
    """Rank / world from torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK); gloo on CPU, nccl on CUDA."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        dev = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{local}")
    owned = False
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
            owned = True
    return Dist(rank, world, dev, owned)
