"""Benchmark: the same replicated state written by 1, 2 and 4 ranks, each
rank's share (dist.partition) to its own target directory through its own
sidecar, all ranks at once; beside it, fio writing the same bytes into the
same directories in parallel (one job per directory, same run).

    python -m ckpt_sidecar.bench_ranks --dir /mnt/nvme/bench [--size 1GiB] [--ranks 1,2,4]

With --nodes, each rank is one node instead: its own sidecar started with
`--shared`, every rank saving the replicated state (each sends its part,
SavePart) into the one shared directory, the step committed once every
marker is in; per world size, the median over --rounds of the slowest
rank's save() -> durable. --bins A,B alternates sidecar binaries (a set of
sidecars each, the order rotated every round) for an A/B in one run.

    python -m ckpt_sidecar.bench_ranks --nodes --dir DIR --size 256MiB --ranks 2,4 --rounds 5 --bins OLD,NEW

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
import signal
import subprocess
import sys
import time

import numpy as np

from . import _units, dist

GIB = 1 << 30


def synthetic(total_bytes, d=1024):
    """A transformer-like list (name, shape, dtype): an embedding of a quarter
    of the bytes, then layers of attention and MLP weights (BF16), biases and
    norms (F32), until `total_bytes` is reached."""
    items = []
    vocab = max(1, total_bytes // 4 // (d * 2))
    items.append(("embed.weight", (vocab, d), np.uint16))
    left, i = total_bytes - vocab * d * 2, 0
    while left > 0:
        layer = [
            (f"layers.{i}.attn.qkv.weight", (3 * d, d), np.uint16),
            (f"layers.{i}.attn.qkv.bias", (3 * d,), np.float32),
            (f"layers.{i}.attn.proj.weight", (d, d), np.uint16),
            (f"layers.{i}.mlp.fc.weight", (4 * d, d), np.uint16),
            (f"layers.{i}.mlp.out.weight", (d, 4 * d), np.uint16),
            (f"layers.{i}.norm.weight", (d,), np.float32),
        ]
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
    parts = dist.partition(
        [(n, int(np.prod(s)) * np.dtype(t).itemsize, np.dtype(t).itemsize, True) for n, s, t in items], world_size
    )
    out = {}
    for name, _shape, dt in items:
        pieces = parts[name]
        for p in pieces:
            if p.rank != rank:
                continue
            key = name if len(pieces) == 1 else dist.piece_name(name, p.start, p.stop)
            a = np.empty(p.stop - p.start, dtype=dt)
            a.view(np.uint8)[:] = (np.arange(a.nbytes, dtype=np.uint32) + (hash(key) & 0xFF)).astype(np.uint8)
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
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, items, dirs[r], staging, barrier, q))
        for r in range(world_size)
    ]
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
        cmd += [
            f"--name=rank{i}",
            f"--filename={os.path.join(d, '.fio-ranks')}",
            "--rw=write",
            "--bs=4M",
            f"--size={size}",
            "--ioengine=io_uring",
            "--direct=1",
            "--iodepth=16",
            "--end_fsync=1",
        ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    for d in dirs:
        try:
            os.unlink(os.path.join(d, ".fio-ranks"))
        except OSError:
            pass
    if out.returncode != 0:
        return None
    j = json.loads(out.stdout[out.stdout.index("{") :])
    return j["jobs"][0]["write"]["bw_bytes"] / GIB


def _node_worker(rank, world_size, items, socks, rounds, barrier, q):
    """One rank of --nodes: the replicated state, one client per binary's
    sidecar, the binaries' saves alternated (rotated order) each round."""
    os.environ.pop("CKPT_SIDECAR_SOCKET", None)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    from .checkpointer import Checkpointer

    state = {}
    for name, shape, dt in items:
        a = np.empty(shape, dtype=dt)
        a.view(np.uint8).reshape(-1)[:] = (np.arange(a.nbytes, dtype=np.uint32) + (hash(name) & 0xFF)).astype(np.uint8)
        state[name] = a
    cks = [Checkpointer(socket=s, spawn=False) for s in socks]
    try:
        for ck in cks:
            ck.reserve(state)
        for r in range(rounds + 1):  # round 0 warms every path, unmeasured
            order = list(range(len(cks)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for b in order:
                barrier.wait()
                t0 = time.perf_counter()
                h = cks[b].save(r + 1, state)
                h.wait_released()
                t1 = time.perf_counter()
                h.wait_durable()
                t2 = time.perf_counter()
                if r:
                    q.put((b, rank, t1 - t0, t2 - t0, r))
    finally:
        for ck in cks:
            ck.close()
    q.put(None)


def run_nodes(base, items, world_size, bins, rounds):
    """--nodes for one world size: {binary index: [slowest rank's durable s per round]}."""
    total = sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in items)
    staging = max(64 << 20, 2 * total // world_size + (256 << 20))
    root = os.path.join(base, f"nodes-w{world_size}")
    shutil.rmtree(root, ignore_errors=True)
    procs, socks = [], [[] for _ in range(world_size)]
    env = dict(os.environ, CKPT_SIDECAR_LOG=os.environ.get("CKPT_SIDECAR_LOG", "warn"))
    try:
        for b, binary in enumerate(bins):
            shared = os.path.join(root, f"bin{b}", "shared")
            os.makedirs(shared)
            for r in range(world_size):
                node = os.path.join(root, f"bin{b}", f"node{r}")
                sock = os.path.join(root, f"bin{b}", f"node{r}.sock")
                os.makedirs(node)
                log = open(os.path.join(root, f"bin{b}", f"node{r}.log"), "wb")
                procs.append(
                    (
                        subprocess.Popen(
                            [
                                binary,
                                "serve",
                                "--dir",
                                node,
                                "--shared",
                                shared,
                                "--socket",
                                sock,
                                "--staging",
                                str(staging),
                                "--keep",
                                "2",
                            ],
                            stdout=log,
                            stderr=log,
                            env=env,
                        ),
                        log,
                    )
                )
                socks[r].append(sock)
        deadline = time.monotonic() + 300
        while not all(os.path.exists(s) for ss in socks for s in ss):
            if any(p.poll() is not None for p, _ in procs) or time.monotonic() > deadline:
                raise SystemExit(f"a sidecar did not start (logs in {root})")
            time.sleep(0.1)
        ctx = mp.get_context("spawn")
        barrier, q = ctx.Barrier(world_size), ctx.Queue()
        workers = [
            ctx.Process(target=_node_worker, args=(r, world_size, items, socks[r], rounds, barrier, q))
            for r in range(world_size)
        ]
        for w in workers:
            w.start()
        got, ended = [], 0
        while ended < world_size:
            x = q.get(timeout=1800)
            if x is None:
                ended += 1
            else:
                got.append(x)
        for w in workers:
            w.join()
            if w.exitcode != 0:
                raise SystemExit(f"rank worker exited with {w.exitcode}")
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            log.close()
        shutil.rmtree(root, ignore_errors=True)
    out = {}
    for b in range(len(bins)):
        rounds_of = {}
        for x in got:
            if x[0] == b:
                rounds_of.setdefault(x[4], []).append(x)
        per_round = [rounds_of[r] for r in sorted(rounds_of)]
        out[b] = {
            "released_s": [max(x[2] for x in rr) for rr in per_round],
            "durable_s": [max(x[3] for x in rr) for rr in per_round],
        }
    return out


def main_nodes(a, items, total):
    bins = [b for b in (a.bins or "").split(",") if b] or [os.environ.get("CKPT_SIDECAR_BIN") or "ckpt-sidecar"]
    print(
        f"state: {len(items)} tensors, {total / GIB:.3f} GiB replicated on every rank; each rank one node (its own "
        f"sidecar with --shared); {os.cpu_count()} CPUs; medians of {a.rounds} rounds, binaries alternated; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    for i, b in enumerate(bins):
        print(f"  bin{i}: {b}")
    print(f"{'ranks':>5} {'bin':>4} {'released s':>11} {'durable s':>10} {'GiB/s':>7}  samples (durable)")
    for w in [int(x) for x in a.ranks.split(",")]:
        res = run_nodes(a.dir, items, w, bins, a.rounds)
        for b, r in res.items():
            rel, dur = sorted(r["released_s"]), sorted(r["durable_s"])
            mr, md = rel[len(rel) // 2], dur[len(dur) // 2]
            print(
                f"{w:>5} {b:>4} {mr:>11.3f} {md:>10.3f} {total / md / GIB:>7.3f}  "
                f"{' '.join(f'{x:.3f}' for x in r['durable_s'])}",
                flush=True,
            )
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ckpt_sidecar.bench_ranks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="base directory; each rank writes under DIR/wN/rank-R")
    ap.add_argument("--size", default="1GiB", help="total state size (default 1GiB)")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes to run (default 1,2,4)")
    ap.add_argument(
        "--nodes",
        action="store_true",
        help="each rank one node: its own sidecar with --shared, parts (SavePart) into one shared directory",
    )
    ap.add_argument("--rounds", type=int, default=3, help="--nodes: measured rounds per world size (default 3)")
    ap.add_argument(
        "--bins",
        default=None,
        help="--nodes: comma-separated ckpt-sidecar binaries to alternate (default: $CKPT_SIDECAR_BIN)",
    )
    a = ap.parse_args(argv)
    total = _units.parse_size(a.size, "--size")
    items = synthetic(total)
    total = sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in items)
    if a.nodes:
        return main_nodes(a, items, total)
    print(
        f"state: {len(items)} tensors, {total / GIB:.3f} GiB (transformer-like: BF16 weights, F32 biases/norms); "
        f"{os.cpu_count()} CPUs; memory warm (second save of each rank measured)"
    )
    print(
        f"{'ranks':>5} {'bytes/rank (MiB)':<34} {'balance':>8} {'slowest s':>10} {'agg GiB/s':>10} "
        f"{'fio GiB/s':>10} {'ratio':>6}"
    )
    worst = 0.0
    for w in [int(x) for x in a.ranks.split(",")]:
        dirs, res = run_ranks(a.dir, items, w)
        per = [n for _, n, _, _ in res]
        slowest = max(t for _, _, t, _ in res)
        balance = max(per) / max(min(per), 1) - 1
        worst = max(worst, balance)
        agg = sum(per) / slowest / GIB
        fio = fio_parallel(dirs, per)
        print(
            f"{w:>5} {' '.join(f'{n / (1 << 20):.1f}' for n in per):<34} {balance * 100:>7.2f}% {slowest:>10.3f} "
            f"{agg:>10.3f} "
            f"{(f'{fio:.3f}' if fio else 'n/a'):>10} {(f'{agg / fio:.2f}' if fio else 'n/a'):>6}",
            flush=True,
        )
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    print(f"balance: worst {worst * 100:.2f}% (bar: < 10 %): {'ok' if worst < 0.10 else 'FAILED'}")
    return 0 if worst < 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
