"""Benchmark: the same replicated state written by 1, 2 and 4 ranks, each
rank's share (dist.partition) to its own target directory through its own
sidecar, all ranks at once; beside it, fio writing the same bytes into the
same directories in parallel (one job per directory, same run).

    python -m ckpt_sidecar.bench_ranks --dir /mnt/nvme/bench [--size 1GiB] [--ranks 1,2,4]

Prints per world size: bytes per rank and their balance (max/min − 1, the
bar is < 10 %), each rank's time from save() to durable, the aggregate
throughput (all bytes / the slowest rank's time, after a common start), and
fio's aggregate throughput over the same directories. Memory is warm: every
rank saves once unmeasured first (its sidecar's staging is pre-faulted at
start anyway, and the save region is reused).
"""
import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from . import dist

GIB = 1 << 30


def parse_size(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def synthetic(total_bytes, d=1024):
    """A transformer-like list (name, shape, dtype): an embedding of a quarter
    of the bytes, then layers of attention and MLP weights (BF16), biases and
    norms (F32), until `total_bytes` is reached."""
    items = []
    vocab = max(1, total_bytes // 4 // (d * 2))
    items.append(("embed.weight", (vocab, d), np.uint16))
    left, i = total_bytes - vocab * d * 2, 0
    while left > 0:
        layer = [(f"layers.{i}.attn.qkv.weight", (3 * d, d), np.uint16), (f"layers.{i}.attn.qkv.bias", (3 * d,), np.float32),
                 (f"layers.{i}.attn.proj.weight", (d, d), np.uint16), (f"layers.{i}.mlp.fc.weight", (4 * d, d), np.uint16),
                 (f"layers.{i}.mlp.out.weight", (d, 4 * d), np.uint16), (f"layers.{i}.norm.weight", (d,), np.float32)]
        for name, shape, dt in layer:
            n = int(np.prod(shape)) * np.dtype(dt).itemsize
            if n > left:
                continue
            items.append((name, shape, dt))
            left -= n
        i += 1
        if all(int(np.prod(s)) * np.dtype(t).itemsize > left for _, s, t in layer):
            break
    return items


def share(items, rank, world_size):
    """This rank's arrays: {stored name: array}, filled with a cheap pattern."""
    parts = dist.partition([(n, int(np.prod(s)) * np.dtype(t).itemsize, np.dtype(t).itemsize, True) for n, s, t in items],
                           world_size)
    out = {}
    for name, shape, dt in items:
        pieces = parts[name]
        for p in pieces:
            if p.rank != rank:
                continue
            key = name if len(pieces) == 1 else dist.piece_name(name, p.start, p.stop)
            a = np.empty(p.stop - p.start, dtype=dt)
            a.view(np.uint8)[:] = (np.arange(a.nbytes, dtype=np.uint32) + (hash(key) & 0xff)).astype(np.uint8)
            out[key] = a
    return out


def _worker(rank, world_size, items, d, staging, barrier, q):
    from .checkpointer import Checkpointer

    os.environ.pop("CKPT_SIDECAR_SOCKET", None)
    mine = share(items, rank, world_size)
    nbytes = sum(a.nbytes for a in mine.values())
    with Checkpointer(dir=d, staging=staging) as ck:
        ck.reserve(mine)
        ck.save(0, mine).wait_durable()  # warm: the save region's pages, the sidecar's paths
        barrier.wait()
        t0 = time.perf_counter()
        ck.save(1, mine).wait_durable()
        q.put((rank, nbytes, time.perf_counter() - t0, time.time()))


def run_ranks(base, items, world_size):
    dirs = [os.path.join(base, f"w{world_size}", f"rank-{r}") for r in range(world_size)]
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    total = sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in items)
    staging = max(64 << 20, 2 * total // world_size + (256 << 20))
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(world_size), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, items, dirs[r], staging, barrier, q)) for r in range(world_size)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"rank worker exited with {p.exitcode}")
    return dirs, res


def fio_parallel(dirs, per_bytes):
    """fio writing per_bytes[i] into dirs[i], every job at once (O_DIRECT, io_uring,
    4 MiB, depth 16, fsync at the end, like the store's own baseline)."""
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--output-format=json", "--group_reporting"]
    for i, (d, n) in enumerate(zip(dirs, per_bytes)):
        size = max(4 << 20, (n + (4 << 20) - 1) // (4 << 20) * (4 << 20))
        cmd += [f"--name=rank{i}", f"--filename={os.path.join(d, '.fio-ranks')}", "--rw=write", "--bs=4M", f"--size={size}",
                "--ioengine=io_uring", "--direct=1", "--iodepth=16", "--end_fsync=1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    for d in dirs:
        try:
            os.unlink(os.path.join(d, ".fio-ranks"))
        except OSError:
            pass
    if out.returncode != 0:
        return None
    j = json.loads(out.stdout[out.stdout.index("{"):])
    return j["jobs"][0]["write"]["bw_bytes"] / GIB


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ckpt_sidecar.bench_ranks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="base directory; each rank writes under DIR/wN/rank-R")
    ap.add_argument("--size", default="1GiB", help="total state size (default 1GiB)")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes to run (default 1,2,4)")
    a = ap.parse_args(argv)
    total = parse_size(a.size)
    items = synthetic(total)
    total = sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in items)
    print(f"state: {len(items)} tensors, {total / GIB:.3f} GiB (transformer-like: BF16 weights, F32 biases/norms); "
          f"{os.cpu_count()} CPUs; memory warm (second save of each rank measured)")
    print(f"{'ranks':>5} {'bytes/rank (MiB)':<34} {'balance':>8} {'slowest s':>10} {'agg GiB/s':>10} {'fio GiB/s':>10} {'ratio':>6}")
    worst = 0.0
    for w in [int(x) for x in a.ranks.split(",")]:
        dirs, res = run_ranks(a.dir, items, w)
        per = [n for _, n, _, _ in res]
        slowest = max(t for _, _, t, _ in res)
        balance = max(per) / max(min(per), 1) - 1
        worst = max(worst, balance)
        agg = sum(per) / slowest / GIB
        fio = fio_parallel(dirs, per)
        print(f"{w:>5} {' '.join(f'{n / (1 << 20):.1f}' for n in per):<34} {balance * 100:>7.2f}% {slowest:>10.3f} {agg:>10.3f} "
              f"{(f'{fio:.3f}' if fio else 'n/a'):>10} {(f'{agg / fio:.2f}' if fio else 'n/a'):>6}", flush=True)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    print(f"balance: worst {worst * 100:.2f}% (bar: < 10 %): {'ok' if worst < 0.10 else 'FAILED'}")
    return 0 if worst < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
