"""A torchrun worker (gloo, CPU) for test_dcp.py: dcp.save of a state with a
replicated part and a part of each rank's own through SidecarWriter (and
through DCP's FileSystemWriter, to compare), then dcp.async_save as the next
step. argv: SIDECAR_DIR FS_DIR."""
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ckpt_sidecar.dcp import SidecarWriter


def state(rank, world_size, scale=1.0):
    g = torch.Generator().manual_seed(0)
    s = {
        "rep": {"w": torch.randn(300, 64, generator=g) * scale, "b": torch.randn(64, generator=g).to(torch.bfloat16),
                "steps": torch.tensor(12), "meta": {"epoch": 3, "name": "run"}},
    }
    for r in range(world_size):
        if r == rank:
            s[f"own{r}"] = torch.arange(1000 * (r + 1), dtype=torch.float64) * scale + r
    return s


def main():
    d, fsd = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    dcp.save(state(r, w), storage_writer=SidecarWriter(d))
    dcp.save(state(r, w), storage_writer=dcp.FileSystemWriter(fsd))
    live = state(r, w, scale=2.0)
    fut = dcp.async_save(live, storage_writer=SidecarWriter(d, step=7))
    # Once async_save returned, the trainer may change its tensors: the
    # checkpoint holds them as they were.
    for t in [live["rep"]["w"], live[f"own{r}"]]:
        t.add_(1000.0)
    fut.result()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
