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

--layout node-local writes each node's shards into its own directory (the
shared one then holds markers and the index); --layout peers also makes the
sidecars peers of each other (each listing all the others, a fresh cluster
secret), so that the commit's doorbells replace the waits for looks at the
shared directory (docs/guide.md, "Peers"); --layout no-shared gives each
node a folder of its own as --shared with --shared-over-peers (no shared
file system: docs/guide.md, "Several nodes without a shared file system").
--layout node-local,peers alternates both in one run, as --bins alternates
binaries. --tensors N
saves N tensors of 1 KiB instead of the model-like state of --size (many
tensors across nodes: each rank's part N / ranks of them).

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
import queue
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


def _node_state(items):
    state = {}
    for name, shape, dt in items:
        a = np.empty(shape, dtype=dt)
        a.view(np.uint8).reshape(-1)[:] = (np.arange(a.nbytes, dtype=np.uint32) + (hash(name) & 0xFF)).astype(np.uint8)
        state[name] = a
    return state


def _node_worker(node, per_node, world_size, items, socks, rounds, barrier, go, q):
    """One node of --nodes: its `per_node` ranks (one thread and one client
    each, ranks node*per_node ...), one client per binary's sidecar, the
    binaries' saves alternated (rotated order) each round. Each measured save
    is reported as (binary, rank, released s, durable s, round, wall-clock
    start, wall-clock durable)."""
    import threading

    os.environ.pop("CKPT_SIDECAR_SOCKET", None)
    from .checkpointer import Checkpointer

    state = _node_state(items)
    ranks = [node * per_node + i for i in range(per_node)]
    cks = {}
    try:
        for rank in ranks:
            # The rank is read from the environment when a Checkpointer is made.
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
            cks[rank] = [Checkpointer(socket=s, spawn=False) for s in socks]
            for ck in cks[rank]:
                ck.reserve(state)
        local = threading.Barrier(per_node)
        errors = []

        def run(rank):
            try:
                for r in range(rounds + 1):  # round 0 warms every path, unmeasured
                    if r == 1:
                        local.wait()  # this node's ranks all done warming
                        if rank == ranks[0]:
                            q.put(("warm", node))
                            go.wait()
                        local.wait()
                    order = list(range(len(socks)))
                    order = order[r % len(order) :] + order[: r % len(order)]
                    for b in order:
                        if rank == ranks[0]:
                            barrier.wait()
                        local.wait()
                        w0, t0 = time.time(), time.perf_counter()
                        h = cks[rank][b].save(r + 1, state)
                        h.wait_released()
                        t1 = time.perf_counter()
                        h.wait_durable()
                        t2, w2 = time.perf_counter(), time.time()
                        if r:
                            q.put((b, rank, t1 - t0, t2 - t0, r, w0, w2))
            except BaseException as e:  # noqa: BLE001 - reported by the main process
                errors.append(e)
                local.abort()
                barrier.abort()

        threads = [threading.Thread(target=run, args=(rank,)) for rank in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    finally:
        for cc in cks.values():
            for ck in cc:
                ck.close()
    q.put(None)


# The file-system system calls counted per step (strace -c names).
FS_SYSCALLS = {
    "open", "openat", "openat2", "creat", "close", "read", "pread64", "readv", "write", "pwrite64", "writev",
    "stat", "lstat", "fstat", "newfstatat", "statx", "access", "faccessat", "faccessat2", "getdents64",
    "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
    "fsync", "fdatasync", "readlink", "readlinkat", "ftruncate", "fallocate", "inotify_add_watch",
}  # fmt: skip


def _strace_start(pid, out):
    p = subprocess.Popen(
        ["strace", "-f", "-c", "-o", out, "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    # Attached once it says so for the process (its threads follow).
    line = p.stderr.readline()
    if not line:
        raise SystemExit(f"strace could not attach to {pid}")
    return p


def _strace_stop(p, out):
    """{syscall: calls} of a stopped strace -c."""
    p.send_signal(signal.SIGINT)
    p.wait(60)
    calls = {}
    with open(out) as f:
        for line in f:
            cols = line.split()
            if len(cols) >= 5 and cols[0][0].isdigit() and cols[-1] != "total":
                # % time, seconds, usecs/call, calls, [errors,] syscall
                calls[cols[-1]] = calls.get(cols[-1], 0) + int(cols[3])
    return calls


def _free_ports(n):
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_secret(path):
    """A fresh cluster secret at `path`: 32 random bytes, owner-only (the
    sidecar refuses a shorter one, or one others may read)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(os.urandom(32))
    return path


def peer_flags(ports, n, secret):
    """`serve` flags of node n of len(ports) local nodes, each a peer of
    all the others (`--peer-listen` on ports[n])."""
    others = ",".join(f"127.0.0.1:{p}" for i, p in enumerate(ports) if i != n)
    return ["--peer-listen", f"127.0.0.1:{ports[n]}", "--peers", others, "--peer-secret-file", secret]


def run_nodes(base, items, nodes, per_node, variants, rounds, trace):
    """--nodes for one node count: {variant index: per-round figures}, and
    with `trace` {(variant index, "coordinator"|"other"): {syscall: calls}}
    over the measured rounds (each variant's sidecars of node 0 and node 1).
    A variant is (binary, layout), alternated: layout "shared" (every shard
    in the shared directory), "node-local", "peers" (node-local, each
    sidecar a peer of all the others) or "no-shared" (peers, each node's
    --shared its own folder: --shared-over-peers)."""
    bins = [b for b, _ in variants]
    world_size = nodes * per_node
    total = sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in items)
    staging = max(8 << 20, 2 * total * per_node // world_size + (4 << 20))
    root = os.path.join(base, f"nodes-n{nodes}x{per_node}")
    shutil.rmtree(root, ignore_errors=True)
    procs, socks = [], [[] for _ in range(nodes)]
    env = dict(os.environ, CKPT_SIDECAR_LOG=os.environ.get("CKPT_SIDECAR_LOG", "warn"))
    traced, got = {}, []
    # Every variant's ports at once: ports picked per variant could be
    # picked twice, the sidecars of the one before not having bound them yet.
    all_ports = _free_ports(nodes * len(variants))
    try:
        for b, (binary, layout) in enumerate(variants):
            shared = os.path.join(root, f"bin{b}", "shared")
            os.makedirs(shared)
            ports = all_ports[b * nodes : (b + 1) * nodes] if layout in ("peers", "no-shared") else []
            if ports:
                secret = write_secret(os.path.join(root, f"bin{b}", "secret"))
            for n in range(nodes):
                node = os.path.join(root, f"bin{b}", f"node{n}")
                sock = os.path.join(root, f"bin{b}", f"node{n}.sock")
                os.makedirs(node)
                log = open(os.path.join(root, f"bin{b}", f"node{n}.log"), "wb")
                if layout == "no-shared":
                    shared = os.path.join(root, f"bin{b}", f"node{n}-shared")
                    os.makedirs(shared)
                cmd = [binary, "serve", "--dir", node, "--shared", shared, "--socket", sock]
                cmd += ["--staging", str(staging), "--keep", "2"]
                if layout in ("node-local", "peers", "no-shared"):
                    cmd += ["--node-local", "--node-id", f"n{n}"]
                if ports:
                    cmd += peer_flags(ports, n, secret)
                if layout == "no-shared":
                    cmd += ["--shared-over-peers"]
                procs.append((subprocess.Popen(cmd, stdout=log, stderr=log, env=env), log))
                socks[n].append(sock)
        deadline = time.monotonic() + 300
        while not all(os.path.exists(s) for ss in socks for s in ss):
            if any(p.poll() is not None for p, _ in procs) or time.monotonic() > deadline:
                raise SystemExit(f"a sidecar did not start (logs in {root})")
            time.sleep(0.1)
        ctx = mp.get_context("spawn")
        barrier, go, q = ctx.Barrier(nodes), ctx.Event(), ctx.Queue()
        workers = [
            ctx.Process(target=_node_worker, args=(n, per_node, world_size, items, socks[n], rounds, barrier, go, q))
            for n in range(nodes)
        ]
        for w in workers:
            w.start()
        ended, warm, tracers = 0, 0, {}
        while ended < nodes:
            try:
                x = q.get(timeout=1)
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    raise SystemExit("a node worker failed (its error is above)") from None
                continue
            if x is None:
                ended += 1
            elif x[0] == "warm":
                warm += 1
                if warm == nodes:
                    if trace:
                        for b in range(len(bins)):
                            for who, n in (("coordinator", 0), ("other", 1)):
                                out = os.path.join(base, f"strace-bin{b}-{who}.txt")
                                tracers[(b, who)] = (_strace_start(procs[b * nodes + n][0].pid, out), out)
                    go.set()
            else:
                got.append(x)
        for who, (p, out) in tracers.items():
            traced[who] = _strace_stop(p, out)
            os.unlink(out)
        for w in workers:
            w.join()
            if w.exitcode != 0:
                raise SystemExit(f"node worker exited with {w.exitcode}")
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
            # The slowest rank: from its own save() to its Durable.
            "durable_s": [max(x[3] for x in rr) for rr in per_round],
            # From the last rank's save() (the first) to every rank Durable.
            "last_s": [max(x[6] for x in rr) - max(x[5] for x in rr) for rr in per_round],
            "first_s": [max(x[6] for x in rr) - min(x[5] for x in rr) for rr in per_round],
        }
    return out, traced


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main_nodes(a, items, total):
    bins = [b for b in (a.bins or "").split(",") if b] or [os.environ.get("CKPT_SIDECAR_BIN") or "ckpt-sidecar"]
    layouts = a.layout.split(",")
    if not set(layouts) <= {"shared", "node-local", "peers", "no-shared"}:
        raise SystemExit(f"--layout {a.layout}: each of shared, node-local, peers, no-shared")
    variants = [(b, layout) for b in bins for layout in layouts]
    if a.strace and shutil.which("strace") is None:
        raise SystemExit("--strace: strace is not installed")
    print(
        f"state: {len(items)} tensors, {total / GIB * 1024:.3f} MiB replicated on every rank; each node its own "
        f"sidecar with --shared, --per-node ranks on it; {os.cpu_count()} CPUs; medians of {a.rounds} rounds, "
        f"variants alternated; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    for i, (b, layout) in enumerate(variants):
        print(f"  variant {i}: {b}, layout {layout}")
    head = f"{'nodes':>5} {'x':>2} {'ranks':>5} {'var':>4} {'released s':>10} {'durable s':>9} "
    head += f"{'last s':>7} {'first s':>7}"
    if a.strace:
        head += f" {'coord fs/step':>13} {'other fs/step':>13}"
    print(head + "  samples (last save -> all durable)")
    for per_node in [int(x) for x in a.per_node.split(",")]:
        for n in [int(x) for x in a.ranks.split(",")]:
            res, traced = run_nodes(a.dir, items, n, per_node, variants, a.rounds, a.strace)
            for b, r in res.items():
                line = f"{n:>5} {per_node:>2} {n * per_node:>5} {b:>4} {_median(r['released_s']):>10.3f} "
                line += f"{_median(r['durable_s']):>9.3f} {_median(r['last_s']):>7.3f} {_median(r['first_s']):>7.3f}"
                if traced:
                    for who in ("coordinator", "other"):
                        fs = sum(c for s, c in traced[(b, who)].items() if s in FS_SYSCALLS)
                        line += f" {fs / a.rounds:>13.1f}"
                print(line + "  " + " ".join(f"{x:.3f}" for x in r["last_s"]), flush=True)
                if traced and a.strace_detail:
                    for who in ("coordinator", "other"):
                        calls = sorted(((c, s) for s, c in traced[(b, who)].items() if s in FS_SYSCALLS), reverse=True)
                        print(f"      {who}: " + ", ".join(f"{s} {c / a.rounds:.1f}" for c, s in calls))
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
    ap.add_argument(
        "--per-node",
        default="1",
        help="--nodes: ranks per node, a list (default 1); --ranks then lists node counts",
    )
    ap.add_argument(
        "--strace",
        action="store_true",
        help="--nodes: count the file-system system calls per step of node 0's sidecar (the coordinator) and node 1's"
        " (each binary's)",
    )
    ap.add_argument("--strace-detail", action="store_true", help="--strace: print the calls by name")
    ap.add_argument(
        "--layout",
        default="shared",
        help="--nodes: every shard in the shared directory (shared, the default), each node's in its own directory"
        " (node-local), or node-local with every sidecar a peer of the others (peers: the commit's doorbells),"
        " or peers with no shared file system (no-shared: each node's --shared its own, --shared-over-peers);"
        " a comma-separated list alternates them (each binary of --bins with each layout)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="--nodes: measured rounds per world size (default 3)")
    ap.add_argument(
        "--bins",
        default=None,
        help="--nodes: comma-separated ckpt-sidecar binaries to alternate (default: $CKPT_SIDECAR_BIN)",
    )
    ap.add_argument(
        "--tensors",
        type=int,
        default=0,
        help="a state of this many tensors of 1 KiB instead of the model-like state of --size",
    )
    a = ap.parse_args(argv)
    total = _units.parse_size(a.size, "--size")
    items = [(f"t.{i:06d}", (256,), np.float32) for i in range(a.tensors)] if a.tensors else synthetic(total)
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
