"""The torch.save import hook's cost, beside the originals in the same run:

    python -m ckpt_sidecar.bench_hook [--dir D] [--sizes 256MiB,1GiB] [--runs 3]

For each state size: plain torch.save (no fsync), torch.save + fsync of the
file and its directory, and the hooked torch.save (return: the file is in
place under its name; durable: its fsyncs done, _hook.flush); the same for
safetensors' save_file. Each figure is the median of --runs, every run into
a fresh path after a sync of the machine's dirty pages, so one run's
writeback does not slow the next; one unmeasured save per method and size
comes first. Prints one line per method and size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from . import _units
from ._bench_limits import fsync_path


def _state(torch, nbytes):
    n = nbytes // 4
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n // 2, generator=g), "b": torch.randn(n - n // 2, generator=g)}


def _timed(save, path, durable):
    """(seconds to return, seconds to durable) of one save of `path`."""
    os.sync()
    t0 = time.perf_counter()
    save(path)
    t_return = time.perf_counter() - t0
    durable(path)
    return t_return, time.perf_counter() - t0


def _plain_fsync(path):
    fsync_path(path)
    fsync_path(os.path.dirname(path), is_dir=True)


def _methods(torch, st, hook, state):
    orig_save = getattr(torch.save, "__wrapped__", torch.save)
    orig_save_file = getattr(st.save_file, "__wrapped__", st.save_file)

    def none(_path):
        pass

    def flushed(_path):
        hook.flush()

    return [
        ("torch.save (plain, no fsync)", lambda p: orig_save(state, p), none),
        ("torch.save + fsync", lambda p: orig_save(state, p), _plain_fsync),
        ("torch.save hooked", lambda p: torch.save(state, p), flushed),
        ("save_file (plain, no fsync)", lambda p: orig_save_file(state, p), none),
        ("save_file + fsync", lambda p: orig_save_file(state, p), _plain_fsync),
        ("save_file hooked", lambda p: st.save_file(state, p), flushed),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ckpt_sidecar.bench_hook", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where the files go (default: a temp folder in the current directory)")
    ap.add_argument("--sizes", default="256MiB,1GiB")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    import torch
    from safetensors import torch as st

    from . import _hook

    _hook.install()  # torch and safetensors are imported: patched now
    base = a.dir or tempfile.mkdtemp(prefix="bench-hook-", dir=".")
    os.makedirs(base, exist_ok=True)
    print(f"{'method':32} {'size':>8} {'return s':>9} {'durable s':>10}  (median of {a.runs}, files in {base})")
    for size in a.sizes.split(","):
        nbytes = _units.parse_size(size)
        state = _state(torch, nbytes)
        warm = os.path.join(base, "warm-up.bin")
        for _, save, durable in _methods(torch, st, _hook, state):
            _timed(save, warm, durable)  # not counted: the first save of a size pays the page cache's growth
            os.remove(warm)
        for name, save, durable in _methods(torch, st, _hook, state):
            runs = []
            for i in range(a.runs):
                path = os.path.join(base, f"{name.split()[0]}-{i}.bin")
                runs.append(_timed(save, path, durable))
                os.remove(path)
            ret = statistics.median(r for r, _ in runs)
            dur = statistics.median(d for _, d in runs)
            durable_s = "-" if durable.__name__ == "none" else f"{dur:10.3f}"
            print(f"{name:32} {size:>8} {ret:9.3f} {durable_s:>10}", flush=True)
        del state
    if not a.dir:
        os.rmdir(base)


if __name__ == "__main__":
    main()
