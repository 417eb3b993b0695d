"""Benchmark: replication to a peer and restore from it, beside a plain TCP
stream over the same loopback in the same run.

    CKPT_SIDECAR_BIN=target/release/ckpt-sidecar python examples/python/bench_peers.py [--gib 1] [--rounds 3]

Two sidecars as two nodes a and b on 127.0.0.1 (`serve --shared S
--node-local --peer-listen ... --peers ... --peer-secret-file K`), rank 0 on
a, rank 1 on b (WORLD_SIZE=2), a replicated state of --gib GiB (each rank
saves its half, as Checkpointer.save does at world size 2). Rows:

- save -> durable: save() to wait_durable() returned, the slower rank
  (medians as replicate's): what replication's copy of each part costs
  the commit;
- tcp x2: two plain TCP streams of half the bytes each at once (a socket
  sender and receiver per stream in this process, 4 MiB pieces, each
  from and into one 4 MiB buffer, so in cache, as iperf3): the baseline
  of both nodes replicating their halves at once;
- tcp x2, step memory: the same streams from a source of half the step
  into a destination of half (pre-faulted, reused round after round):
  what moving the step's bytes through TCP costs in memory traffic, which
  replication pays and the cached baseline does not;
- replicate: each step's durable -> held by peers (wait_durable returned ->
  wait_peers returned) on both ranks, the slower of the two; throughput =
  the step's bytes / that time (median of --rounds steps after --warm-up
  steps: a peer's replicas land in the memory of the ones it evicted, so
  with `--peer-keep 2` the first 3 steps of a layout get fresh memory,
  which a job that saves every step pays only at its start; this state's
  first two steps are written as 4 shards and the later ones as one, so
  the buffers fit from step 6 on, hence 5 warm-up steps); and each
  sidecar's own figure (status: bytes of its files / seconds from connect
  to the peer's Held, every byte checked there);
- tcp x1: one plain TCP stream of all the bytes: the baseline of a restore;
- fresh shm: a new /dev/shm segment of the state's size reserved and
  mapped populated (what a new load region costs before its first byte:
  the client reserves the pages, the sidecar maps them), the floor of any
  load into new memory on this machine;
- restore: b killed, its disk emptied, a new b started; rank 1's
  load("latest") of the whole state (its node's half from a's RAM, a's
  half from a's disk through a, every tensor checked), wall time;
- restore's read: the new b's sidecar's own read of the files into the
  load's region (its log's read_seconds): the restore without the new
  memory;
- with --spill, every replica goes to disk (`--peer-budget 1MiB
  --peer-spill DIR` on both nodes): replicate and restore then measure
  the spill;
- load on a: rank 0's load("latest") on a, no network (its half from its
  page cache, b's half from the replica a holds): the load path's own cost.

Replication sends each part's files from a copy taken while the part's
staging image is still there (into memory reused step after step), not
from disk.
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

GIB = 1 << 30
PIECE = 4 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tcp_streams(n_bytes, n_streams, memory=None):
    """Seconds for n_streams plain TCP streams of n_bytes each, at once, over
    loopback: from and into one PIECE-sized buffer per stream (in cache, as
    iperf3 does), or, given `memory` (n_streams pairs of pre-faulted
    buffers of n_bytes, from stream_memory), from each stream's source
    into its destination, as a replication moves a step's bytes."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    src = bytearray(os.urandom(PIECE))
    pairs = iter(memory) if memory is not None else None

    def receive(c, dst):
        view, got = memoryview(dst if dst is not None else bytearray(PIECE)), 0
        while got < n_bytes:
            at = got if dst is not None else 0
            n = c.recv_into(view[at:], min(PIECE, n_bytes - got))
            if n == 0:
                break
            got += n
        c.close()

    def send(source):
        view = memoryview(source if source is not None else src)
        with socket.create_connection(("127.0.0.1", port)) as c:
            left = n_bytes
            while left:
                k = min(PIECE, left)
                at = n_bytes - left if source is not None else 0
                c.sendall(view[at : at + k])
                left -= k
            c.shutdown(socket.SHUT_WR)
            c.recv(1)

    given = [next(pairs) if pairs is not None else (None, None) for _ in range(n_streams)]
    t0 = time.perf_counter()
    senders = [threading.Thread(target=send, args=(s,)) for s, _ in given]
    for t in senders:
        t.start()
    receivers = []
    for _, dst in given:
        c, _ = srv.accept()
        receivers.append(threading.Thread(target=receive, args=(c, dst)))
        receivers[-1].start()
    for t in receivers + senders:
        t.join()
    srv.close()
    return time.perf_counter() - t0


def stream_memory(n_bytes, n_streams):
    """n_streams (source, destination) pairs of n_bytes each, every page
    written once (reused round after round, as the peers' pools are)."""
    return [(bytearray(b"\x5a") * n_bytes, bytearray(b"\x00") * n_bytes) for _ in range(n_streams)]


def read_seconds(log):
    """The read_seconds of the last load a sidecar's log tells of."""
    with open(log) as f:
        lines = [ln for ln in f if "read into the client's region" in ln]
    return float(re.search(r"read_seconds=([0-9.e-]+)", lines[-1]).group(1))


def fresh_shm(n_bytes):
    """Seconds for a new /dev/shm segment of n_bytes, reserved (posix_fallocate)
    and mapped populated: what a new load region costs before the load."""
    import mmap

    name = f"/dev/shm/bench-peers-{os.getpid()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        os.posix_fallocate(fd, 0, n_bytes)
        m = mmap.mmap(fd, n_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        took = time.perf_counter() - t0
        m.close()
        return took
    finally:
        os.close(fd)
        os.unlink(name)


WORKER = r"""
import json, os, sys, time
import numpy as np
from ckpt_sidecar import Checkpointer

shared, steps, mode, gib = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3], float(sys.argv[4])
n = int(gib * (1 << 30)) // 4 // 8

def state(step):
    return {f"w{i}": np.full(n, step * 10 + i, dtype=np.float32) for i in range(8)}

out = []
with Checkpointer(dir=shared, spawn=False) as ck:
    for s in steps:
        if mode == "save":
            st = state(s)
            t0 = time.perf_counter()
            h = ck.save(s, st).wait_durable(timeout=600)
            t1 = time.perf_counter()
            h.wait_peers(timeout=600)
            out.append((t1 - t0, time.perf_counter() - t1))
        else:
            t0 = time.perf_counter()
            got = ck.load("latest")
            out.append(time.perf_counter() - t0)
            want = state(steps[0])
            assert all(np.array_equal(got[k], want[k]) for k in want), "not bit-equal"
print(json.dumps(out))
"""


class Node:
    def __init__(self, tmp, name, ports, shared, secret, staging, extra=()):
        other = "b" if name == "a" else "a"
        self.dir, self.sock = os.path.join(tmp, f"L_{name}"), os.path.join(tmp, f"{name}.sock")
        self.log = os.path.join(tmp, f"{name}.log")
        self.cmd = [
            os.environ.get("CKPT_SIDECAR_BIN", "ckpt-sidecar"),
            "serve",
            "--dir",
            self.dir,
            "--socket",
            self.sock,
            "--staging",
            staging,
            "--keep",
            "2",
            "--shared",
            shared,
            "--node-local",
            "--node-id",
            name,
            "--peer-listen",
            f"127.0.0.1:{ports[name]}",
            "--peers",
            f"127.0.0.1:{ports[other]}",
            "--peer-secret-file",
            secret,
            *extra,
        ]
        self.proc = None

    def start(self):
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=f)
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise SystemExit(open(self.log).read()[-3000:])
            time.sleep(0.05)
        return self

    def status(self):
        out = subprocess.run([self.cmd[0], "status", "--socket", self.sock, "--json"], capture_output=True, text=True)
        return json.loads(out.stdout)

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        os.unlink(self.sock)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def ranks(nodes, shared, steps, mode, gib, only=None):
    procs = []
    for r, n in enumerate(nodes):
        if only is not None and r != only:
            continue
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", CKPT_SIDECAR_SOCKET=n.sock)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, shared, steps, mode, str(gib)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(o) for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-up", type=int, default=5, help="steps saved before the measured ones")
    ap.add_argument(
        "--spill",
        action="store_true",
        help="each node lends 1 MiB of memory and a spill folder (--peer-budget 1MiB --peer-spill): every "
        "replica is received into files and restored from them",
    )
    a = ap.parse_args()
    n_bytes = int(a.gib * GIB)
    tmp = tempfile.mkdtemp(prefix="bench-peers-")
    try:
        shared = os.path.join(tmp, "shared")
        os.mkdir(shared)
        secret = os.path.join(tmp, "K")
        with open(secret, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(secret, 0o600)
        ports = {"a": free_port(), "b": free_port()}
        staging = str(int(n_bytes * 1.5))
        extra = ("--peer-budget", "1MiB", "--peer-spill", os.path.join(tmp, "spill_{}")) if a.spill else ()
        nodes = [Node(tmp, n, ports, shared, secret, staging, [x.format(n) for x in extra]).start() for n in ("a", "b")]
        tcp2 = statistics.median(tcp_streams(n_bytes // 2, 2) for _ in range(a.rounds))
        memory = stream_memory(n_bytes // 2, 2)
        tcp2_mem = statistics.median(tcp_streams(n_bytes // 2, 2, memory) for _ in range(a.rounds))
        del memory
        last = a.warm_up + a.rounds
        steps = ",".join(str(s) for s in range(1, last + 1))
        per_rank = ranks(nodes, shared, steps, "save", a.gib)
        measured = list(zip(*per_rank))[a.warm_up :]
        durable = statistics.median(max(r[0] for r in x) for x in measured)
        repl = statistics.median(max(r[1] for r in x) for x in measured)
        own = [n.status()["peers"]["bytes_per_s"] for n in nodes]
        tcp1 = statistics.median(tcp_streams(n_bytes, 1) for _ in range(a.rounds))
        fresh = statistics.median(fresh_shm(n_bytes) for _ in range(a.rounds))
        nodes[1].kill()
        shutil.rmtree(nodes[1].dir)
        os.mkdir(nodes[1].dir)
        nodes[1].start()
        restore = ranks(nodes, shared, str(last), "load", a.gib, only=1)[0][0]
        restore_read = read_seconds(nodes[1].log)
        local = ranks(nodes, shared, str(last), "load", a.gib, only=0)[0][0]
        gbs = lambda b, s: b / s / 1e9  # noqa: E731
        print(
            f"state: {n_bytes / GIB:.2f} GiB per step, half per node; {a.rounds} rounds after {a.warm_up} warm-up "
            "steps (medians)"
        )
        print(f"tcp x2 (baseline)   {gbs(n_bytes, tcp2):6.2f} GB/s   ({tcp2:.3f} s for two streams of half at once)")
        print(f"save -> durable     {gbs(n_bytes, durable):6.2f} GB/s   ({durable:.3f} s, the slower rank)")
        print(
            f"replicate           {gbs(n_bytes, repl):6.2f} GB/s   ({repl:.3f} s durable -> held, both nodes) "
            f"= {tcp2 / repl:.2f} x baseline; sidecars' own: {', '.join(f'{x / 1e9:.2f}' for x in own)} GB/s"
        )
        print(
            f"tcp x2, step memory {gbs(n_bytes, tcp2_mem):6.2f} GB/s   ({tcp2_mem:.3f} s: each stream from a source "
            f"of half the step into a destination of half, as replication moves them); replicate "
            f"= {tcp2_mem / repl:.2f} x this"
        )
        print(f"tcp x1 (baseline)   {gbs(n_bytes, tcp1):6.2f} GB/s   ({tcp1:.3f} s)")
        print(
            f"fresh shm (floor)   {gbs(n_bytes, fresh):6.2f} GB/s   ({fresh:.3f} s: a new region of the state's "
            "size, its pages reserved and mapped, as a load into new memory pays before a byte arrives)"
        )
        print(
            f"restore from peer   {gbs(n_bytes, restore):6.2f} GB/s   ({restore:.3f} s, load('latest') on the new "
            f"node, every tensor checked) = {tcp1 / restore:.2f} x baseline"
        )
        print(
            f"restore's read      {gbs(n_bytes, restore_read):6.2f} GB/s   ({restore_read:.3f} s: the new node's "
            f"sidecar's read of the files into the region, from its log) = {tcp1 / restore_read:.2f} x baseline"
        )
        print(
            f"load on a (no net)  {gbs(n_bytes, local):6.2f} GB/s   ({local:.3f} s: its half from its page cache, "
            f"b's from the replica in its RAM: the load path's own cost)"
        )
        for n in nodes:
            n.stop()
    finally:
        if os.environ.get("BENCH_PEERS_KEEP"):
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
