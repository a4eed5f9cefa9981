"""Data-parallel training across processes started by `accelerate launch` or `torchrun`.

Every process holds the whole (small) drafter, draws its own batches, and averages gradients with
one all-reduce per step before clipping, so all replicas take identical optimizer steps. No
DistributedDataParallel wrapper: training calls `forward_train`, not `forward`, and DDP's hooks
are tied to `forward`. A single process (WORLD_SIZE unset or 1) gets a `Dist` whose collectives
do nothing, so the training loop reads the same either way.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def average_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        if self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for g in grads:
            g.copy_(flat[i: i + g.numel()].view_as(g))
            i += g.numel()

    def sum_ints(self, values: list[int], device: torch.device | str) -> list[int]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.long, device=device)
        dist.all_reduce(t)
        return [int(v) for v in t.tolist()]

    def broadcast_int(self, value: int, device: torch.device | str) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def weight_digests(self, module: torch.nn.Module) -> list[str]:
        """Each replica's weight fingerprint (all equal when the replicas stayed in step)."""
        h = hashlib.sha256()
        for k, v in sorted(module.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().float().cpu().numpy().tobytes())
        mine = h.hexdigest()[:16]
        if self.world == 1:
            return [mine]
        out: list[str | None] = [None] * self.world
        dist.all_gather_object(out, mine)
        return [str(d) for d in out]

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_dist(device: str) -> tuple[Dist, str]:
    """(Dist, this process's device). NCCL on CUDA (one GPU per process), gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), device
    on_cuda = device.startswith("cuda")
    if on_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size()), device
