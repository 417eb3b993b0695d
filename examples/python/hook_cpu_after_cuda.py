#!/usr/bin/env python3
"""torch.save of a CPU-only state dict through the import hook once CUDA is
initialised in the process, with and without the hook's walk for CUDA
storages (_hook._may_hold_cuda), alternated in one run against the sidecar
the hook spawns.

Arms (medians over --reps timed repetitions each, after one untimed warm-up
each; the arms take turns within every repetition):

  walk            the hook as it is: the walk finds no CUDA storage, the host
                  way runs (one pickling pass)
  skip_data_pass  the walk replaced by "may hold one" (the hook before the
                  walk): a skip_data pass first, then the host way
  cuda_not_init   the walk never runs (CUDA not initialised: the floor)

Each figure is the time torch.save takes to return (the sidecar holds the
file); the file is made durable before the next save, outside the timing.
Also the walk alone (walk_s). Without a GPU, "CUDA initialised" is
simulated (_hook._cuda_possible answers yes; no CUDA call is made); with
one, torch.cuda.init() runs and only cuda_not_init is simulated.

  python hook_cpu_after_cuda.py [--tensors 1000] [--numel 1024] [--reps 15] [--json]
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--numel", type=int, default=1024, help="float32 elements per tensor (default 1024: 4 KiB)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="hookwalk")
    os.environ["CKPT_SIDECAR_SOCKET"] = os.path.join(tmp, "none.sock")  # the hook spawns its own
    os.environ.setdefault("CKPT_SIDECAR_STAGING", "256MiB")
    import torch
    from ckpt_sidecar import _hook

    _hook.install()
    real_cuda = torch.cuda.is_available()
    if real_cuda:
        torch.cuda.init()
    real_possible, real_walk = _hook._cuda_possible, _hook._may_hold_cuda
    cuda_on = real_possible if real_cuda else (lambda torch: True)

    from collections import OrderedDict

    state = OrderedDict((f"layer{i}.weight", torch.randn(args.numel)) for i in range(args.tensors))
    path = os.path.join(tmp, "state.pt")
    torch.save({"warm": 1}, path)  # spawns the sidecar (this file is written here)
    if not _hook.wait_sidecar(120):
        sys.exit("no sidecar answered")
    _hook.flush()

    arms = {
        "walk": (cuda_on, real_walk),
        "skip_data_pass": (cuda_on, lambda obj, torch: True),
        "cuda_not_init": (lambda torch: False, real_walk),
    }
    samples = {k: [] for k in arms}
    walk = []
    try:
        for r in range(args.reps + 1):
            for name, (possible, may_hold) in arms.items():
                _hook._cuda_possible, _hook._may_hold_cuda = possible, may_hold
                t0 = time.perf_counter()
                torch.save(state, path)
                t1 = time.perf_counter()
                if not _hook.flush(120):
                    sys.exit("a file did not become durable")
                if r:
                    samples[name].append(t1 - t0)
            t0 = time.perf_counter()
            held = real_walk(state, torch)
            t1 = time.perf_counter()
            assert not held, "the walk found a CUDA storage in a CPU state"
            if r:
                walk.append(t1 - t0)
    finally:
        _hook._cuda_possible, _hook._may_hold_cuda = real_possible, real_walk
        _hook.flush(120)
        shutil.rmtree(tmp, ignore_errors=True)
    cuda = _hook.cuda_counts()
    assert cuda["device"] == 0, cuda
    med = {k: statistics.median(v) for k, v in samples.items()}
    res = {
        "tensors": args.tensors, "tensor_bytes": args.numel * 4, "reps": args.reps, "real_cuda": real_cuda,
        "median_s": med, "walk_s": statistics.median(walk),
        "saved_s": med["skip_data_pass"] - med["walk"],
        "walk_over_no_cuda": med["walk"] / med["cuda_not_init"],
        "samples": samples, "counts": _hook.counts(),
    }
    print(f"hooked torch.save of {args.tensors} CPU tensors x {args.numel * 4} B, CUDA "
          f"{'initialised' if real_cuda else 'initialised (simulated)'}; medians of {args.reps}, arms alternated:")
    for k in arms:
        print(f"  {k:15s} {med[k] * 1e3:8.2f} ms")
    print(f"  walk alone      {res['walk_s'] * 1e3:8.3f} ms; saved per save {res['saved_s'] * 1e3:.2f} ms "
          f"({(1 - med['walk'] / med['skip_data_pass']) * 100:.0f} %)")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
