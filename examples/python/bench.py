#!/usr/bin/env python3
"""The Python shim's bars, measured in one run on one state dict of --size-mib
MiB of float32 tensors (transformer-like: many 16 MiB matrices, some small
vectors), against a `ckpt-sidecar serve` this script starts and stops.

Figures (medians over --reps timed repetitions, after one untimed warm-up
repetition each, so every buffer is warm; all samples are in the JSON):

  memcpy_s                  one memcpy (ctypes.memmove, one thread) of the same bytes
                            into a pre-faulted buffer
  sidecar_stall_s           ck.save() until released (the trainer may change its
                            tensors), the tensors in private memory: the shim copies
                            them into shared memory, which is the snapshot
  sidecar_taken_s           ck.save() until the sidecar's Released (it holds its
                            own copy in staging; from then on the checkpoint
                            commits even if the trainer dies)
  sidecar_resident_stall_s  the tensors live in shared memory (ck.share): time
                            inside save() plus time blocked in the guarded
                            optimizer step, with a simulated forward/backward
                            (a sleep, as when a GPU computes: 1.5 x the sidecar's
                            copy time) between the two
  torch_save_s              torch.save of the same dict to a file in --dir
  torch_save_fsync_s        the same plus flush + fsync
  persist_s                 the sidecar's write + commit time (Durable's figure)
  hook_torch_save_s         torch.save of the same dict through the import hook
                            (what an unmodified script gets with CKPT_SIDECAR=1):
                            until it returns, i.e. serialised into a temp file
                            beside the path and renamed over it
  hook_torch_save_durable_s the same until the file is durable (the file and its
                            directory synced by the hook's thread)

Bars: sidecar_stall_s <= 1.25 x memcpy_s; sidecar_resident_stall_s <= 0.1 x
memcpy_s and >= 50 x below torch_save_fsync_s.

Second figure (--loop-steps, 0 skips it): a training loop whose step takes
1.25 x the persist time, run without checkpoints and checkpointing every step
(resident state, guarded optimizer step), alternately: --loop-rounds
checkpointing loops, each between two plain ones and compared with their
mean; the overhead in % is the median over the rounds (bar: <= 3 %). Kinds
of step: "cpu" (single-threaded matmuls, a fixed amount: the trainer competes
with the sidecar for the CPU),
"cpu_pinned" (the same with the trainer on one core and the sidecar on the
others, as `--cpus` / Checkpointer(cpus=...) arrange; 2+ CPUs only) and
"gpu_like" (a sleep: the CPU is free, as when an accelerator computes).

  python bench.py --size-mib 1024 --json [--dir DIR]
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

import ckpt_sidecar as cs
from ckpt_sidecar import _native
from ckpt_sidecar import bench_compare as _bc


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    p.add_argument("--dir", default=None, help="checkpoint and torch.save directory (default: a temp dir in /tmp)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per figure")
    p.add_argument("--loop-steps", type=int, default=8, help="steps per loop in the second figure (0: skip it)")
    p.add_argument("--loop-rounds", type=int, default=3,
                   help="checkpointing loops per kind, each between two plain loops; the figure is their median")
    p.add_argument("--keep-dir", action="store_true", help="do not remove --dir's checkpoints at the end")
    p.add_argument("--many-tensors", action="store_true",
                   help="only the per-tensor figures: 1000 and 4000 tensors x 4 KiB (shared, and copied at save) "
                        "against one 4 MiB tensor, alternately in one run, beside a memcpy of the same bytes")
    p.add_argument("--only-loop", action="store_true",
                   help="only the training-loop figure (and the saves it needs for the persist time): "
                        "no memcpy, torch.save or resident-stall figures")
    return p.parse_args()


def make_state(size_mib):
    """size_mib MiB of float32 (bench compare's state: 16 MiB matrices, a tail, 32 small norms)."""
    return _bc.make_state(size_mib << 20)


nbytes_of = _bc.nbytes
med = _bc.med


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Sidecar:
    """A `ckpt-sidecar serve` with enough staging for two images in flight."""

    def __init__(self, ckdir, staging_bytes):
        self.tmp = tempfile.mkdtemp(prefix="ckpt-bench-")
        self.sock = os.path.join(self.tmp, "sidecar.sock")
        self.log = os.path.join(self.tmp, "sidecar.log")
        env = dict(os.environ, CKPT_SIDECAR_LOG=os.environ.get("CKPT_SIDECAR_LOG", "warn"))
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([_native.sidecar_binary(), "serve", "--dir", ckdir, "--socket", self.sock,
                                          "--staging", str(staging_bytes), "--keep", "2"],
                                         stdout=f, stderr=f, env=env)

    def connect(self, timeout=300):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"sidecar exited {self.proc.returncode}: {open(self.log).read()[-2000:]}")
            if os.path.exists(self.sock):
                try:
                    return cs.Checkpointer(socket=self.sock, spawn=False)
                except cs.SidecarError:
                    pass
            if time.monotonic() > deadline:
                raise SystemExit(f"sidecar not ready after {timeout} s")
            time.sleep(0.1)

    def pin(self, cpus):
        """Runs every thread of the sidecar (and those they start) on `cpus`."""
        for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:
                pass  # a thread that just ended

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def bench_memcpy(state, reps):
    dst = {k: torch.empty_like(t) for k, t in state.items()}
    out = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        for k, t in state.items():
            ctypes.memmove(dst[k].data_ptr(), t.data_ptr(), t.numel() * t.element_size())
        if r:
            out.append(time.perf_counter() - t0)
    del dst
    return out


def bench_torch_save(state, d, reps, sync):
    out = []
    for r in range(reps + 1):
        path = os.path.join(d, f"torch-save-{r}.pt")
        t0 = time.perf_counter()
        if sync:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            torch.save(state, path)
        if r:
            out.append(time.perf_counter() - t0)
        os.unlink(path)
    return out


def bench_hook_torch_save(state, d, sock, reps):
    """torch.save through the import hook, against the running sidecar: until it
    returns, and until the file is durable; then torch.save is restored."""
    from ckpt_sidecar import _hook

    os.environ["CKPT_SIDECAR_SOCKET"] = sock
    _hook.install()  # torch is imported: patched now
    path = os.path.join(d, "hook.pt")
    ret, durable = [], []
    try:
        for r in range(reps + 1):
            t0 = time.perf_counter()
            torch.save(state, path)
            t1 = time.perf_counter()
            _hook.flush()
            t2 = time.perf_counter()
            if r:
                ret.append(t1 - t0)
                durable.append(t2 - t0)
        counts = _hook.counts()
    finally:
        torch.save, torch.load = torch.save.__wrapped__, torch.load.__wrapped__
        if os.path.exists(path):
            os.remove(path)
    return ret, durable, counts


def bench_many_tensors(args):
    """Per-tensor cost: states of many 4 KiB float32 tensors against one tensor
    of the same bytes, saved alternately (one round = every state once, in a
    rotated order), medians of --reps rounds after one warm-up round. All
    memory is warm: the states, the shared regions, the save regions and the
    sidecar's staging are allocated and touched before the first timed round.

    Per state: save_s (inside save()), released_s (save() + wait_released:
    the trainer's stall), durable_after_released_s (wait_released's return to
    Durable), sidecar_copy_s (the sidecar's copy, as it reports), and
    memcpy_s (one ctypes.memmove per tensor of the same bytes, warm)."""
    import numpy as np

    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-many-")
    os.makedirs(base, exist_ok=True)
    ckdir = os.path.join(base, "ckpt")
    side = Sidecar(ckdir, 256 << 20)
    res = {"mode": "many_tensors", "reps": args.reps, "cpus": os.cpu_count(), "dir": base, "memory": "warm"}
    try:
        ck = side.connect()

        def many(n, kb=4):
            return {f"layers.{i}.w": np.random.default_rng(i).random(kb * 256, dtype=np.float32) for i in range(n)}

        states = {
            "shared_1x4MiB": ck.share({"w": np.random.default_rng(0).random(1 << 20, dtype=np.float32)}),
            "shared_1000x4KiB": ck.share(many(1000)),
            "shared_4000x4KiB": ck.share(many(4000)),
            "copied_1x4MiB": {"w": np.random.default_rng(0).random(1 << 20, dtype=np.float32)},
            "copied_1000x4KiB": many(1000),
            "copied_4000x4KiB": many(4000),
        }
        ck.reserve(max(sum(a.nbytes + 64 for a in s.values()) for s in states.values()))
        names = list(states)
        samples = {k: {"save_s": [], "released_s": [], "durable_after_released_s": [], "sidecar_copy_s": [],
                       "memcpy_s": []} for k in names}
        dst = np.empty(4 << 20, dtype=np.float32)  # memcpy target (16 MiB, the largest state), warm
        dst[:] = 0
        step = 0
        for r in range(args.reps + 1):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                st = samples[k]
                step += 1
                t0 = time.perf_counter()
                h = ck.save(step, states[k])
                t1 = time.perf_counter()
                h.wait_released()
                t2 = time.perf_counter()
                h.wait_durable()
                t3 = time.perf_counter()
                t4 = time.perf_counter()
                off = 0
                for a in states[k].values():
                    ctypes.memmove(dst.ctypes.data + off, a.ctypes.data, a.nbytes)
                    off += a.nbytes
                t5 = time.perf_counter()
                if r:
                    st["save_s"].append(t1 - t0)
                    st["released_s"].append(t2 - t0)
                    st["durable_after_released_s"].append(t3 - t2)
                    st["sidecar_copy_s"].append(h.figures()["copy_s"])
                    st["memcpy_s"].append(t5 - t4)
            log(f"round {r}/{args.reps} done")
        ck.close()
    finally:
        side.stop()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(ckdir, ignore_errors=True)
    out = {}
    for k, st in samples.items():
        out[k] = {f: med(v) for f, v in st.items()}
        out[k]["samples"] = st
    res["states"] = out
    s1, s1k, s4k = out["shared_1x4MiB"], out["shared_1000x4KiB"], out["shared_4000x4KiB"]
    res["shared_1000_released_over_1x4MiB_durable"] = s1k["durable_after_released_s"] / s1["durable_after_released_s"]
    res["shared_4000_over_1000_released"] = s4k["released_s"] / s1k["released_s"]
    res["bars"] = {
        "shared_1000x4KiB_released_le_3ms": s1k["released_s"] <= 0.003,
        "shared_1000x4KiB_durable_le_1.5x_1x4MiB": res["shared_1000_released_over_1x4MiB_durable"] <= 1.5,
        "shared_4000_scales_linearly": res["shared_4000_over_1000_released"] <= 4.0,
    }
    if args.json:
        print(json.dumps(res))
        return
    print(f"{'state':20s} {'save()':>10s} {'+released':>10s} {'->durable':>10s} {'sc copy':>10s} {'memcpy':>10s}  (ms, medians of {args.reps}, warm)")
    for k in names:
        o = out[k]
        print(f"{k:20s} " + " ".join(f"{1e3 * o[f]:10.3f}" for f in
                                     ("save_s", "released_s", "durable_after_released_s", "sidecar_copy_s", "memcpy_s")))
    print(json.dumps(res["bars"]))


def main():
    args = parse_args()
    if args.many_tensors:
        return bench_many_tensors(args)
    own_dir = args.dir is None
    base = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-dir-")
    os.makedirs(base, exist_ok=True)
    ckdir = os.path.join(base, "ckpt")
    state = make_state(args.size_mib)
    size = nbytes_of(state)
    log(f"state: {len(state)} tensors, {size / 2**20:.0f} MiB; dir {base}; torch threads {torch.get_num_threads()}")

    res = {"size_mib": args.size_mib, "bytes": size, "tensors": len(state), "reps": args.reps,
           "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "dir": base}

    samples = {}
    if not args.only_loop:
        samples["memcpy_s"] = bench_memcpy(state, args.reps)
        log(f"memcpy: {samples['memcpy_s']}")
        samples["torch_save_s"] = bench_torch_save(state, base, args.reps, sync=False)
        log(f"torch.save: {samples['torch_save_s']}")
        samples["torch_save_fsync_s"] = bench_torch_save(state, base, args.reps, sync=True)
        log(f"torch.save + fsync: {samples['torch_save_fsync_s']}")

    side = Sidecar(ckdir, 2 * size + (256 << 20))
    try:
        t0 = time.perf_counter()
        ck = side.connect()
        log(f"sidecar ready in {time.perf_counter() - t0:.1f} s (staging {2 * size + (256 << 20)} bytes, pre-faulted)")
        step = 0

        # 1. Tensors in private memory: copied into shared memory at save.
        os.sync()  # torch.save's files above: no writeback competes with what follows
        if hasattr(ck, "reserve"):
            ck.reserve(state)  # pre-fault the save regions (the shim reuses them warm)
        stall, taken, copy_s, persist = [], [], [], []
        for r in range(args.reps + 1):
            step += 1
            t0 = time.perf_counter()
            h = ck.save(step, state)
            h.wait_released()  # the trainer may change its tensors again
            dt = time.perf_counter() - t0
            wait_taken = getattr(h, "wait_taken", None)  # the sidecar holds its own copy
            if wait_taken is not None:
                wait_taken()
            dt_taken = time.perf_counter() - t0
            h.wait_durable()
            f = h.figures()
            if r:
                stall.append(dt)
                taken.append(dt_taken)
                copy_s.append(f["copy_s"])
                persist.append(f["persist_s"])
        samples["sidecar_stall_s"], samples["sidecar_taken_s"] = stall, taken
        samples["sidecar_copy_s"], samples["persist_s"] = copy_s, persist
        log(f"sidecar stall (copied at save): {stall}; until the sidecar's Released {taken}; "
            f"sidecar copy {copy_s}; persist {persist}")

        # 2. Resident: the tensors live in shared memory for good.
        ck.share(state)
        params = [torch.nn.Parameter(t, requires_grad=False) for t in state.values()]
        opt = torch.optim.SGD(params, lr=0.0)  # no grads: the step itself changes nothing
        ck.guard(opt)
        marks = {}
        opt.register_step_pre_hook(lambda o, a, k: marks.__setitem__("hook", time.perf_counter()))
        fwd_bwd = 1.5 * med(copy_s) + 0.01
        resident, in_save, in_step, shim_stall, copied = [], [], [], [], []
        for r in range(0 if args.only_loop else args.reps + 1):
            step += 1
            t0 = time.perf_counter()
            h = ck.save(step, state)
            t1 = time.perf_counter()
            time.sleep(fwd_bwd)  # forward + backward on a GPU: the CPU is free for the sidecar
            t2 = time.perf_counter()
            opt.step()  # the guard waits here for the release
            blocked = marks["hook"] - t2
            h.wait_durable()
            if r:
                in_save.append(t1 - t0)
                in_step.append(blocked)
                resident.append(t1 - t0 + blocked)
                shim_stall.append(h.stall_seconds)
                copied.append(h.copied_bytes)
        if not args.only_loop:
            samples["sidecar_resident_stall_s"] = resident
        res["resident_in_save_s"], res["resident_in_guarded_step_s"] = med(in_save), med(in_step)
        res["resident_shim_stall_seconds"] = med(shim_stall)
        res["resident_copied_bytes_in_trainer"] = max(copied) if copied else None
        res["simulated_fwd_bwd_s"] = fwd_bwd
        log(f"resident stall: {resident} (in save {in_save}, in guarded step {in_step}; trainer copied {copied} bytes)")

        # 2b. torch.save through the import hook (an unmodified script); after the
        # resident figure, so its shared-memory regions do not disturb that one.
        if not args.only_loop:
            ret, durable, counts = bench_hook_torch_save(state, base, side.sock, args.reps)
            samples["hook_torch_save_s"], samples["hook_torch_save_durable_s"] = ret, durable
            res["hook_counts"] = counts
            log(f"hooked torch.save: returned {ret}, durable {durable}; files {counts}")

        # 3. A training loop: checkpoint every step vs none, step time > persist time.
        if args.loop_steps > 0:
            torch.set_num_threads(1)
            a = torch.rand(384, 384)
            t0 = time.perf_counter()
            for _ in range(20):
                a = torch.mm(a, a).clamp_(0, 1)
            per_mm = (time.perf_counter() - t0) / 20
            target = 1.25 * med(persist)
            n_mm = max(1, int(target / per_mm))

            def cpu_step():
                x = a
                for _ in range(n_mm):
                    x = torch.mm(x, a).clamp_(0, 1)
                return x

            def gpu_like_step():
                time.sleep(target)  # the accelerator computes; the trainer's CPU waits

            def run(train_step, ckpt):
                nonlocal step
                train_step()  # warm
                t0 = time.perf_counter()
                for _ in range(args.loop_steps):
                    if ckpt:
                        step += 1
                        ck.save(step, state)
                    train_step()
                    opt.step()  # guarded: waits for the release of this step's save
                total = time.perf_counter() - t0
                if ckpt:
                    ck._last.wait_durable()
                return total / args.loop_steps

            for _ in range(3):  # calibrate on the real step: its time must exceed the persist time
                t0 = time.perf_counter()
                cpu_step()
                n_mm = max(1, round(n_mm * target / (time.perf_counter() - t0)))

            kinds = [("cpu", cpu_step, f"{n_mm} single-thread 384x384 matmuls per step", None),
                     ("gpu_like", gpu_like_step, f"a {target:.3f} s sleep per step (CPU free)", None)]
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) >= 2:
                # As `ckpt-sidecar serve --cpus` would: the trainer on one core, the sidecar on the others.
                kinds.append(("cpu_pinned", cpu_step, f"{n_mm} single-thread 384x384 matmuls per step; trainer on "
                              f"cpu {cpus[0]}, sidecar on cpus {cpus[1:]}", (cpus[0], cpus[1:])))
            loops = {}
            for kind, fn, work, pinning in kinds:
                trainer_cpus, sidecar_cpus = ({pinning[0]}, set(pinning[1])) if pinning else (set(cpus), set(cpus))
                os.sched_setaffinity(0, trainer_cpus)  # this thread: torch runs the matmuls on it
                side.pin(sidecar_cpus)
                # Checkpointing loops alternate with plain ones; each is compared with
                # the mean of its two neighbours (the machine's speed drifts), and the
                # figure is the median over the rounds.
                seq = [run(fn, False)]
                for _ in range(args.loop_rounds):
                    seq += [run(fn, True), run(fn, False)]
                base = [(seq[i - 1] + seq[i + 1]) / 2 for i in range(1, len(seq), 2)]
                ckpt = seq[1::2]
                over = [100 * (c / b - 1) for c, b in zip(ckpt, base)]
                loop = {"steps": args.loop_steps, "rounds": args.loop_rounds, "persist_s": med(persist), "work": work,
                        "step_s_no_ckpt": med(seq[0::2]), "step_s_no_ckpt_runs": seq[0::2],
                        "step_s_ckpt_every_step": med(ckpt), "step_s_ckpt_runs": ckpt,
                        "overhead_pct_rounds": over}
                loop["overhead_pct"] = med(over)
                loop["step_exceeds_persist"] = loop["step_s_no_ckpt"] > loop["persist_s"]
                loop["bar_overhead_le_3pct"] = loop["overhead_pct"] <= 3 and loop["step_exceeds_persist"]
                loops[kind] = loop
                log(f"loop ({kind}): {loop}")
            os.sched_setaffinity(0, set(cpus))
            side.pin(set(cpus))
            res["loop"] = loops
        ck.close()
    finally:
        side.stop()
        if own_dir and not args.keep_dir:
            shutil.rmtree(base, ignore_errors=True)
        elif not args.keep_dir:
            shutil.rmtree(ckdir, ignore_errors=True)

    for k, v in samples.items():
        res[k] = med(v)
        res[k + "_samples"] = v
    res["bars"] = {}
    if not args.only_loop:
        m = res["memcpy_s"]
        res["stall_over_memcpy"] = res["sidecar_stall_s"] / m
        res["resident_over_memcpy"] = res["sidecar_resident_stall_s"] / m
        res["torch_save_fsync_over_resident"] = res["torch_save_fsync_s"] / res["sidecar_resident_stall_s"]
        res["torch_save_fsync_over_stall"] = res["torch_save_fsync_s"] / res["sidecar_stall_s"]
        res["torch_save_fsync_over_hook"] = res["torch_save_fsync_s"] / res["hook_torch_save_s"]
        res["bars"] = {
            "stall_le_1.25x_memcpy": res["stall_over_memcpy"] <= 1.25,
            "resident_le_0.1x_memcpy": res["resident_over_memcpy"] <= 0.1,
            "resident_50x_below_torch_save_fsync": res["torch_save_fsync_over_resident"] >= 50,
        }
    for kind, loop in res.get("loop", {}).items():
        res["bars"][f"loop_{kind}_overhead_le_3pct"] = loop["bar_overhead_le_3pct"]
    res["notes"] = ("medians after one untimed warm-up per figure (warm memory); memcpy is one thread; "
                    "the resident figure's forward/backward is a sleep (CPU free, as with a GPU); "
                    "loop 'cpu': the step is single-thread CPU matmuls, competing with the sidecar for the "
                    "machine's cores; loop 'gpu_like': the step is a sleep (the CPU is free, as when a GPU computes)")
    if not args.json and not args.only_loop:
        for k in ("memcpy_s", "sidecar_stall_s", "sidecar_resident_stall_s", "torch_save_s", "torch_save_fsync_s",
                  "persist_s", "stall_over_memcpy", "resident_over_memcpy", "torch_save_fsync_over_resident"):
            print(f"{k:32s} {res[k]:.6f}")
        print(json.dumps(res["bars"]))
    elif not args.json:
        print(json.dumps(res["bars"]))
    else:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
