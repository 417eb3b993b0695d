#!/usr/bin/env python3
"""Restore in a resumed trainer: Checkpointer.load() against load_into(),
each in a fresh trainer process, beside fio's O_DIRECT read of the same
bytes in the same directory, in one run.

For each size: a setup process saves bench compare's state (16 MiB float32
matrices, the rest in one tail tensor, 32 small norms) as step 1 in DIR.
Then --rounds rounds, the order of the methods rotated between rounds; each
method runs in a fresh Python process that first allocates and touches the
trainer's state (its pages warm, as a resumed trainer's model and optimizer
are), then spawns its own sidecar on DIR (so the checkpoint is read from
disk, not from a resident image; its staging holds the checkpoint, as
Checkpointer's default does) and times:

  load        ck.load(): the state as views of a new load region
  load+copy   ck.load(), then every tensor copied into the trainer's own
              tensors (what a trainer does with load()'s result:
              load_state_dict / copy_)
  load_into   ck.load_into(state): into the trainer's own tensors in place
  load_into_shared  the same with the state in shared memory (ck.share(state)
              before the clock starts, as a trainer that saves in place
              does): the sidecar writes the tensors itself

and the same call again in the same process (`again`: load() reuses its
region once the first load's tensors are gone; load_into frees its region
before returning, so it pays fresh pages again). Every method checks one
element of every tensor against the saved values.

  python examples/python/bench_restore.py --dir /tmp/bench-restore --sizes 256MiB,1GiB --rounds 3 [--json]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

METHODS = ("load", "load+copy", "load_into", "load_into_shared")


def log(msg):
    print(f"[bench restore {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def child(method, ckdir, spec_path):
    """One fresh trainer: {"first_s", "again_s"} on stdout as JSON."""
    import torch
    import ckpt_sidecar as cs

    spec = json.loads(open(spec_path).read())
    state = {}
    for name, (shape, _) in spec.items():
        state[name] = torch.empty(shape).fill_(-1.0)  # touched: warm pages
    out = {}
    size = sum(t.numel() * 4 for t in state.values())
    with cs.Checkpointer(dir=ckdir, staging=size + (64 << 20)) as ck:
        ck.list()  # the sidecar is up before the clock starts
        if method == "load_into_shared":
            ck.share(state)
        for key in ("first_s", "again_s"):
            t0 = time.perf_counter()
            if method.startswith("load_into"):
                assert ck.load_into(state, 1) == 1
            else:
                got = ck.load(1)
                if method == "load+copy":
                    with torch.no_grad():
                        for name, t in state.items():
                            t.copy_(got[name])
                    del got
            out[key] = time.perf_counter() - t0
            assert ck.last_load_source == "disk", ck.last_load_source
            src = state if method != "load" else got
            for name, (_, first) in spec.items():
                assert float(src[name].reshape(-1)[0]) == first, f"{method}: {name} differs"
            if method == "load":
                del got, src
    print(json.dumps(out))


def setup(ckdir, size_bytes, spec_path):
    import torch
    import ckpt_sidecar as cs
    from ckpt_sidecar.bench_compare import make_state

    state = make_state(size_bytes)
    json.dump({k: (list(v.shape), float(v.reshape(-1)[0])) for k, v in state.items()}, open(spec_path, "w"))
    with cs.Checkpointer(dir=ckdir, staging=size_bytes + (256 << 20)) as ck:
        ck.save(1, state).wait_durable(600)
    del state, torch


def run_child(method, ckdir, spec_path):
    r = subprocess.run([sys.executable, __file__, "--child", method, ckdir, spec_path],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{method} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(*sys.argv[2:5])
    from ckpt_sidecar.bench_compare import fio, parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir in /tmp)")
    p.add_argument("--sizes", default="256MiB,1GiB", type=lambda s: [parse_size(x) for x in s.split(",")])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON object on the last line of standard output")
    args = p.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="bench-restore-")
    os.makedirs(base, exist_ok=True)
    results, limits = [], []
    try:
        for size in args.sizes:
            ckdir = os.path.join(base, f"ck-{size}")
            shutil.rmtree(ckdir, ignore_errors=True)
            spec = os.path.join(base, f"spec-{size}.json")
            log(f"{size >> 20} MiB: saving step 1")
            setup(ckdir, size, spec)
            samples = {m: {"first_s": [], "again_s": []} for m in METHODS}
            reads = []
            for r in range(args.rounds):
                order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
                for m in order:
                    log(f"{size >> 20} MiB, round {r + 1}/{args.rounds}: {m}")
                    got = run_child(m, ckdir, spec)
                    for k, v in got.items():
                        samples[m][k].append(v)
                log(f"{size >> 20} MiB, round {r + 1}/{args.rounds}: fio read")
                reads.append(fio(ckdir, size, "read"))
            reads = [x for x in reads if x is not None]
            fio_read_s = statistics.median(reads) if reads else None
            limits.append({"size_bytes": size, "fio_read_s": fio_read_s, "fio_read_samples_s": reads})
            for m in METHODS:
                first, again = statistics.median(samples[m]["first_s"]), statistics.median(samples[m]["again_s"])
                results.append({"method": m, "size_bytes": size, "first_s": first, "again_s": again,
                                "first_over_fio_read": first / fio_read_s if fio_read_s else None,
                                "samples": samples[m]})
            shutil.rmtree(ckdir, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{'method':17s} {'size':>8s} {'first s':>9s} {'GB/s':>7s} {'÷ fio read':>10s} {'again s':>9s}")
    for r in results:
        ratio = f"{r['first_over_fio_read']:.2f}" if r["first_over_fio_read"] else "-"
        print(f"{r['method']:17s} {r['size_bytes'] / 2**20:6.0f}Mi {r['first_s']:9.3f} "
              f"{r['size_bytes'] / r['first_s'] / 1e9:7.2f} {ratio:>10s} {r['again_s']:9.3f}")
    for e in limits:
        f = f"{e['fio_read_s']:9.3f}" if e["fio_read_s"] else "        -"
        print(f"{'fio read':17s} {e['size_bytes'] / 2**20:6.0f}Mi {f}")
    if args.json:
        print(json.dumps({"results": results, "limits": limits}))


if __name__ == "__main__":
    main()
