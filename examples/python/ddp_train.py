"""A data-parallel (DDP, gloo, CPU) trainer that checkpoints through one
sidecar per node and resumes bit for bit after SIGKILL.

    ckpt-sidecar launch --dir ckpt -- torchrun --standalone --nproc-per-node 2 \\
        examples/python/ddp_train.py --steps 12 --every 3 [--resume] [--kill-at 6] [--out final.pt]

Every rank holds the same model and AdamW state (DDP all-reduces the
gradients); `Checkpointer.save` sends each rank's part of it (balanced by
bytes) and the sidecar commits every rank's part as one checkpoint, with each
rank's RNG state (dropout) beside it. `--resume` loads `latest` on every rank
(the whole state, its own RNG) and trains on. `--kill-at STEP`: every rank
SIGKILLs itself once its part of STEP's checkpoint is released (after a
barrier, so every part is): the step still commits. Each step's batch comes
from a generator seeded with (seed, step, rank), so a resumed run computes
exactly what an uninterrupted one does. `--out FILE` (rank 0): torch.save of
the final model and optimizer state, to compare runs.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ckpt_sidecar import Checkpointer


def build(d=64, vocab=256):
    return nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, vocab))


def batch(seed, step, rank, n=16, seq=8, vocab=256):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, (x * 7 + 3) % vocab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="ckpt")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-at", type=int, default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(a.seed)  # the same initial model on every rank
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(a.seed * 7919 + rank)  # dropout: per rank
    ck = Checkpointer(dir=a.dir)
    start = 1
    if a.resume and ck.latest() is not None:
        st = ck.load("latest", restore_rng=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        start = st["step"] + 1
        if rank == 0:
            print(f"resumed from step {st['step']} (world size {ck.world_size})", flush=True)
    ddp = DDP(model)
    for step in range(start, a.steps + 1):
        x, y = batch(a.seed, step, rank)
        loss = nn.functional.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.every == 0:
            h = ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, rng=True)
            if step == a.kill_at:
                h.wait_released()
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            h.wait_durable()
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}, checkpoint durable", flush=True)
    if a.out and rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, a.out)
    dist.barrier()
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
