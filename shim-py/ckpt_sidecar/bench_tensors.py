"""Benchmark: the per-tensor cost of a save, each state beside one tensor of
the same bytes saved by the same sidecar in the same run.

    python -m ckpt_sidecar.bench_tensors --dir DIR [--counts 1000,10000,100000] [--json]
    ckpt-sidecar bench tensors --dir DIR ...        (the same)

Every state lives in shared memory (`ck.share`), memory warm. Rows:

- alternate: 1,000 x 4 KiB saved alternately with one 4 MiB tensor, medians
  of --rounds after two warm-up rounds (issue 31's first bar: save() +
  wait_released() <= 1.5 ms, released -> durable <= 1.5 x the one tensor's);
- N x 1 KiB for each of --counts, the same structure saved 7 times, medians
  of the last 5, then one tensor of N KiB the same way (the second bar at
  10k: save + released <= 10 ms, released -> durable <= 2 x one tensor's +
  10 ms); per tensor: save()'s own return and save() -> released, in us;
- the same through the C ABI (ckpt_save of a prepared descriptor array,
  then ckpt_wait: no Python walk);
- replan: the first save of a changed structure (one tensor more) against
  the cached saves of the one before;
- load: `load()` of the N-tensor step against the one tensor's step, and the
  index's size;
- ranks: --ranks processes against the same sidecar (RANK, WORLD_SIZE), a
  replicated state of --ranks x --rank-tensors x 1 KiB that each rank saves
  (its part: --rank-tensors tensors), all ranks at once, 7 steps, medians of
  the last 5 per rank; then one tensor per rank of the same bytes;
- nodes (--nodes): the ranks rows again, each rank on a sidecar of its own
  as a node of its own (`serve --shared S --node-local`, every sidecar a
  peer of the others: the commit's doorbells), the step committed by rank
  0's sidecar from every rank's marker.

With --incremental-off the rows are measured again against a sidecar
started with `--incremental off` (the default is on).
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from . import _native as N
from ._bench_methods import Sidecar

INDEX_FILE = "model.safetensors.index.json"


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Stepper:
    """Saves of one Checkpointer, each step a fresh number."""

    def __init__(self, ck):
        self.ck, self.step = ck, 0

    def save(self, state):
        """(save() s, save() -> released s, released -> durable s)."""
        self.step += 1
        t0 = time.perf_counter()
        h = self.ck.save(self.step, state)
        t1 = time.perf_counter()
        h.wait_released()
        t2 = time.perf_counter()
        h.wait_durable()
        return t1 - t0, t2 - t0, time.perf_counter() - t2

    def save_c(self, descs, n, blobs, n_blobs):
        """The same through the C ABI alone: ckpt_save of a prepared array, ckpt_wait."""
        self.step += 1
        lib, client, sid = N.lib(), self.ck._live_client(), ctypes.c_uint64()
        t0 = time.perf_counter()
        N.check(lib.ckpt_save(client, self.step, descs, n, blobs, n_blobs, ctypes.byref(sid)))
        t1 = time.perf_counter()
        N.check(lib.ckpt_wait(client, sid.value, N.RELEASED, -1))
        t2 = time.perf_counter()
        N.check(lib.ckpt_wait(client, sid.value, N.DURABLE, -1))
        return t1 - t0, t2 - t0, time.perf_counter() - t2


def many(n, kib):
    return {f"layers.{i}.experts.w": np.full(kib * 256, i % 251, dtype=np.float32) for i in range(n)}


def figures(samples):
    return {
        "save_s": med([s[0] for s in samples]),
        "released_s": med([s[1] for s in samples]),
        "durable_after_released_s": med([s[2] for s in samples]),
    }


def repeated(st, state, times=7, keep=5):
    return figures([st.save(state) for _ in range(times)][-keep:])


def alternate(st, ck, rounds):
    a = ck.share(many(1000, 4))
    b = ck.share({"w": np.full(1 << 20, 1, dtype=np.float32)})
    sa, sb = [], []
    for r in range(rounds + 2):
        for k in (0, 1) if r % 2 == 0 else (1, 0):
            s = st.save(a if k == 0 else b)
            if r >= 2:
                (sa if k == 0 else sb).append(s)
    fa, fb = figures(sa), figures(sb)
    return {
        "state": "1000 x 4 KiB alternated with 1 x 4 MiB",
        "many": fa,
        "one": fb,
        "durable_ratio": fa["durable_after_released_s"] / fb["durable_after_released_s"],
        "bars": {
            "released_le_1.5ms": fa["released_s"] <= 1.5e-3,
            "durable_le_1.5x_one": fa["durable_after_released_s"] <= 1.5 * fb["durable_after_released_s"],
        },
    }


def load_s(ck, step, times=3):
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        got = ck.load(step)
        out.append(time.perf_counter() - t0)
        del got
    return med(out)


def counted(st, ck, ckdir, n, c_abi):
    """The rows of N x 1 KiB and of one N KiB tensor."""
    state = ck.share(many(n, 1))
    one = ck.share({"w": np.full(n * 256, 1, dtype=np.float32)})
    t0 = time.perf_counter()
    first = st.save(state)
    row = {
        "n": n,
        "first_save_s": first[0],
        "first_released_s": first[1],
        "first_plan_wall_s": time.perf_counter() - t0,
    }
    row["many"] = repeated(st, state)
    index_path = os.path.join(ckdir, f"step-{st.step:012d}", INDEX_FILE)
    row["index_bytes"] = os.path.getsize(index_path) if os.path.exists(index_path) else None
    if c_abi:
        # The descriptors the Python package prepared, sent as a C caller would.
        plan = next(p for p in reversed(ck._save_plans) if p.n == n)
        blobs = plan.blob_array(plan.blobs[0])
        row["c_abi"] = figures([st.save_c(plan.descs, plan.n, blobs, len(plan.blobs[0])) for _ in range(7)][-5:])
    # Loaded while it is among the steps retention keeps (--keep 2); a
    # load's region makes the next save of each state prepare it again.
    row["load_many_s"] = load_s(ck, st.step)
    row["one"] = repeated(st, one)
    row["load_one_s"] = load_s(ck, st.step)
    # A changed structure: one tensor more costs one replan, then cached again.
    state["layers.extra"] = ck.share({"x": np.zeros(256, dtype=np.float32)})["x"]
    row["replan"] = st.save(state)
    row["after_replan"] = repeated(st, state, times=3, keep=2)
    del state["layers.extra"]
    m, o = row["many"], row["one"]
    row["per_tensor_us"] = {"save": 1e6 * m["save_s"] / n, "released": 1e6 * m["released_s"] / n}
    row["durable_over_one"] = m["durable_after_released_s"] / o["durable_after_released_s"]
    if n == 10000:
        row["bars"] = {
            "released_le_10ms": m["released_s"] <= 0.010,
            "durable_le_2x_one_plus_10ms": m["durable_after_released_s"] <= 2 * o["durable_after_released_s"] + 0.010,
        }
    return row


def _rank_worker(rank, world_size, n, sock, first_step, barrier, q):
    """One rank: the replicated N x world_size state (its part: ~N tensors),
    then one tensor per rank of the same bytes, each saved 7 times in step
    with the other ranks, from step first_step + 1 on. A rank that fails
    breaks the barrier, so the others fail too instead of waiting."""
    from .checkpointer import Checkpointer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), CKPT_SIDECAR_SOCKET=sock)
    try:
        with Checkpointer(socket=sock, spawn=False) as ck:
            st = Stepper(ck)
            st.step = first_step
            out = {}
            states = (
                ("many", many(n * world_size, 1)),
                ("one", {f"w{r}": np.full(n * 256, 1, dtype=np.float32) for r in range(world_size)}),
            )
            for label, state in states:
                state = ck.share(state)
                samples = []
                for _ in range(7):
                    barrier.wait(600)
                    samples.append(st.save(state))
                out[label] = figures(samples[-5:])
        q.put((rank, out))
    except BaseException as e:
        barrier.abort()
        q.put((rank, f"{type(e).__name__}: {e}"))
        raise


def ranks(socks, n, world_size, first_step):
    """The --ranks rows, rank r on the sidecar of socks[r % len(socks)]: each
    rank's figures, by rank."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(world_size), ctx.Queue()
    procs = [
        ctx.Process(target=_rank_worker, args=(r, world_size, n, socks[r % len(socks)], first_step, barrier, q))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=1800) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        raise SystemExit(f"rank workers failed: {failed}")
    return {"world_size": world_size, "tensors_per_rank": n, "by_rank": [got[r] for r in range(world_size)]}


def run(args, incremental):
    base = os.path.join(args.dir, "incremental-" + ("on" if incremental else "off"))
    shutil.rmtree(base, ignore_errors=True)
    ckdir = os.path.join(base, "ckpt")
    os.makedirs(ckdir)
    biggest = max(max(args.counts), args.ranks * args.rank_tensors)
    staging = max(256 << 20, 4 * biggest * 1024 + (64 << 20))
    side = Sidecar(ckdir, staging, extra=() if incremental else ("--incremental", "off"))
    out = {"incremental": incremental, "rows": []}
    try:
        ck = side.connect()
        st = Stepper(ck)
        out["alternate"] = alternate(st, ck, args.rounds)
        log(f"incremental {'on' if incremental else 'off'}: alternate done")
        for n in args.counts:
            out["rows"].append(counted(st, ck, ckdir, n, not args.no_c_abi))
            log(f"incremental {'on' if incremental else 'off'}: {n} tensors done")
        ck.close()
        if args.ranks > 1:
            out["ranks"] = ranks([side.sock], args.rank_tensors, args.ranks, st.step)
            log(f"incremental {'on' if incremental else 'off'}: {args.ranks} ranks done")
    finally:
        side.stop()
    try:
        if args.ranks > 1 and args.nodes:
            out["nodes"] = nodes(base, staging, args.rank_tensors, args.ranks, () if incremental else OFF)
            log(f"incremental {'on' if incremental else 'off'}: {args.ranks} nodes done")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


OFF = ("--incremental", "off")


def nodes(base, staging, n, world_size, extra):
    """The --nodes rows: --ranks ranks, each on a sidecar of its own as a
    node of its own (node-local, every sidecar a peer of the others)."""
    from .bench_ranks import _free_ports, peer_flags, write_secret

    shared = os.path.join(base, "shared")
    os.makedirs(shared)
    secret = write_secret(os.path.join(base, "secret"))
    ports = _free_ports(world_size)
    sides = []
    try:
        for r in range(world_size):
            flags = ["--shared", shared, "--node-local", "--node-id", f"n{r}"] + peer_flags(ports, r, secret)
            sides.append(Sidecar(os.path.join(base, f"node{r}"), staging, extra=tuple(flags) + tuple(extra)))
        for side in sides:
            side.connect().close()
        return ranks([side.sock for side in sides], n, world_size, 0)
    finally:
        for side in sides:
            side.stop()


def ms(x):
    return f"{1e3 * x:9.3f}"


def print_run(r):
    print(f"\nincremental {'on' if r['incremental'] else 'off'} (ms; medians)")
    a = r["alternate"]
    print(f"  {a['state']}:")
    for k in ("many", "one"):
        f = a[k]
        print(
            f"    {k:5s} save {ms(f['save_s'])}  +released {ms(f['released_s'])}  "
            f"->durable {ms(f['durable_after_released_s'])}"
        )
    print(f"    durable ratio {a['durable_ratio']:.2f}  bars {json.dumps(a['bars'])}")
    print(f"  {'state':>16s} {'save':>9s} {'+released':>9s} {'->durable':>9s} {'us/t save':>9s} {'us/t rel':>9s}")
    for row in r["rows"]:
        n = row["n"]
        for label, f in (
            (f"{n} x 1 KiB", row["many"]),
            (f"1 x {n} KiB", row["one"]),
            (f"C ABI {n}", row.get("c_abi")),
        ):
            if f is None:
                continue
            per = (
                f"{1e6 * f['save_s'] / n:9.3f} {1e6 * f['released_s'] / n:9.3f}" if not label.startswith("1 x") else ""
            )
            print(f"  {label:>16s} {ms(f['save_s'])} {ms(f['released_s'])} {ms(f['durable_after_released_s'])} {per}")
        rp = row["replan"]
        print(
            f"  {'':>16s} first save {ms(row['first_save_s'])}, replan (+1 tensor) save {ms(rp[0])} released "
            f"{ms(rp[1])}, then {ms(row['after_replan']['released_s'])}; durable / one {row['durable_over_one']:.2f}"
        )
        print(
            f"  {'':>16s} load {ms(row['load_many_s'])} vs one tensor {ms(row['load_one_s'])} "
            f"({1e6 * (row['load_many_s'] - row['load_one_s']) / n:.2f} us/tensor over it); "
            f"index {row['index_bytes']} bytes"
        )
        if "bars" in row:
            print(f"  {'':>16s} bars {json.dumps(row['bars'])}")
    for key, where in (("ranks", "one sidecar"), ("nodes", "each its own sidecar as a node, peers")):
        rk = r.get(key)
        if not rk:
            continue
        n = rk["tensors_per_rank"]
        print(f"  {rk['world_size']} ranks, {where}, each rank's part {n} x 1 KiB, beside 1 x {n} KiB per rank:")
        for rank, f in enumerate(rk["by_rank"]):
            for k, label in (("many", f"rank {rank} {n} x 1 KiB"), ("one", f"rank {rank} 1 x {n} KiB")):
                g = f[k]
                per = f"{1e6 * g['save_s'] / n:9.3f} {1e6 * g['released_s'] / n:9.3f}" if k == "many" else ""
                d = g["durable_after_released_s"]
                print(f"  {label:>22s} {ms(g['save_s'])} {ms(g['released_s'])} {ms(d)} {per}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="bench tensors", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (a subfolder per run, removed after)")
    p.add_argument("--counts", default="1000,10000,100000", help="tensor counts of 1 KiB (comma-separated)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the alternating states")
    p.add_argument("--incremental-off", action="store_true", help="also against a sidecar with --incremental off")
    p.add_argument("--no-c-abi", action="store_true", help="skip the C ABI rows")
    p.add_argument("--ranks", type=int, default=2, help="rank processes of the ranks rows (0 or 1: no such rows)")
    p.add_argument("--rank-tensors", type=int, default=10000, help="tensors of 1 KiB in each rank's part")
    p.add_argument(
        "--nodes",
        action="store_true",
        help="the ranks rows again, each rank on a sidecar of its own as a node (--shared --node-local, peers)",
    )
    p.add_argument("--json", action="store_true", help="one JSON document on the last line")
    args = p.parse_args(argv)
    args.counts = [int(c) for c in args.counts.split(",") if c]
    os.makedirs(args.dir, exist_ok=True)
    args.dir = tempfile.mkdtemp(prefix="bench-tensors-", dir=args.dir)
    try:
        load = os.getloadavg()
        res = {"loadavg_before": load, "cpus": os.cpu_count(), "runs": [run(args, True)]}
        if args.incremental_off:
            res["runs"].append(run(args, False))
        res["loadavg_after"] = os.getloadavg()
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"load average before {res['loadavg_before'][0]:.1f}, after {res['loadavg_after'][0]:.1f}")
    for r in res["runs"]:
        print_run(r)
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
