#!/usr/bin/env python3
"""bench compare: the sidecar against the checkpointing tools people would
use instead, on the same state, in the same run, on this machine.

For each size: a transformer-like state of float32 tensors (bench.py's
make_state) is saved by every method, methods rotated between rounds, the
median of --rounds rounds after --warmup untimed rounds. Memory is warm for
every method alike: the state, the sidecar's staging and save regions, and
the memcpy target are allocated and touched before the first round, and the
warm-up rounds fault in whatever each method allocates itself.

Per method and size: stall_s (until the trainer may change its tensors),
durable_s (until the bytes are on disk: fsync'd or committed; null for a
method that never syncs), restore_s (back into memory, verified where the
method verifies; files written through the page cache are dropped from it
first with posix_fadvise, so every restore reads the disk).
Limits, same run, same directory: fio sequential O_DIRECT write and read of
the same size (the best of two configurations), and one memcpy.

Methods: sidecar_copied (tensors in private memory, copied at save),
sidecar_shared (tensors already in shared memory, ck.share), torch_save,
torch_save_fsync, safetensors_fsync, dcp_save, dcp_async_save (its blocking
part is the stall, its future's completion durable), deepspeed_fastpersist
(DeepSpeed's FastPersist writer, deepspeed.io.FastFileWriter: torch.save into
an O_DIRECT file through libaio and a page-locked double buffer, synchronous;
only where deepspeed imports and its async_io op builds (libaio-dev, ninja; a
JIT build of minutes the first time), else skipped with exactly what failed
printed).

  ckpt-sidecar bench compare --dir DIR --sizes 256MiB,1GiB [--rounds 3] [--json] [--plot out.png]
  python -m ckpt_sidecar.bench_compare --dir DIR --sizes 256MiB,1GiB ...   (the same)

LoRA-like state (--lora ADAPTER_SIZE): each size is a frozen base that never
changes, plus ADAPTER_SIZE of adapters (float32) with AdamW-like state (two
moments of the same size), all three written in place (torch add_) before
every save. Extra methods then: sidecar_trust (incremental="trust-version":
the frozen base is proven unchanged by torch's version counters; its row is
the steady state of saving every step: an untimed save of the state right
before each timed one, and no restore, which would evict the image it takes
from) and sidecar_changed_only (the adapters and moments alone: what the
changed tensors cost). --loop-lora does the same for the training loop
(a frozen MLP with rank-8 adapters per layer, AdamW on the adapters only),
with the extra loop method sidecar_trust.

Progress goes to stderr; the table to stdout; with --json the JSON document
is the last line of stdout.
"""

import argparse
import contextlib
import ctypes
import gc
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from . import _native, _units
from .checkpointer import Checkpointer
from .errors import SidecarError


def parse_size(s):
    """A size as the command line takes it (_units: store/src/units.rs's meaning)."""
    try:
        return _units.parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# The smallest state make_state builds: its 32 norm vectors of 1024 float32.
STATE_BYTES_MIN = 32 * 4096


def log(msg):
    print(f"[bench compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def make_state(size_bytes):
    """size_bytes of float32: 16 MiB matrices, the rest in one tail tensor, plus 32 small norms."""
    g = torch.Generator().manual_seed(0)
    state, total, i = {}, size_bytes - 32 * 4096, 0
    big = 16 << 20
    while total >= big:
        state[f"layers.{i}.weight"] = torch.rand(1024, 4096, generator=g)
        total -= big
        i += 1
    if total >= 4:
        state["tail.weight"] = torch.rand(total // 4, generator=g)
    for j in range(32):
        state[f"layers.{j}.norm.weight"] = torch.rand(1024, generator=g)
    return state


def make_lora_state(base_bytes, adapter_bytes):
    """A frozen base of about base_bytes (make_state's tensors) and adapters of
    adapter_bytes float32 in 1 MiB tensors, each with two AdamW-like moments;
    returns (state, the tensors written at every step)."""
    state = {f"base.{k}": t for k, t in make_state(base_bytes).items()}
    g = torch.Generator().manual_seed(1)
    changing = []
    n = max(1, adapter_bytes // (1 << 20))
    per = max(1, adapter_bytes // n // 4)
    for i in range(n):
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            t = torch.rand(per, generator=g)
            state[f"adapter.{i}.{kind}"] = t
            changing.append(t)
    return state, changing


def train_adapters(changing):
    """One optimizer step's writes: every adapter tensor and moment in place."""
    with torch.no_grad():
        for t in changing:
            t.add_(1e-3)


def nbytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(path):
    """Drops `path`'s pages (a file, or every file under a folder) from the page cache."""
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path, is_dir=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if is_dir else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Sidecar:
    """A `ckpt-sidecar serve` of its own (the binary: $CKPT_SIDECAR_BIN, set by
    `ckpt-sidecar bench compare` to itself), staging allocated and pre-faulted
    at start."""

    def __init__(self, ckdir, staging_bytes, drain=None, extra=()):
        self.tmp = tempfile.mkdtemp(prefix="bench-compare-sidecar-")
        self.sock = os.path.join(self.tmp, "sidecar.sock")
        self.log = os.path.join(self.tmp, "sidecar.log")
        env = dict(os.environ, CKPT_SIDECAR_LOG=os.environ.get("CKPT_SIDECAR_LOG", "warn"))
        with open(self.log, "wb") as f:
            binary = os.environ.get("CKPT_SIDECAR_BIN") or _native.sidecar_binary()  # bench compare: itself
            self.proc = subprocess.Popen(
                [binary, "serve", "--dir", ckdir, "--socket", self.sock, "--staging", str(staging_bytes), "--keep", "2"]
                + (["--drain", drain] if drain else [])
                + list(extra),
                stdout=f,
                stderr=f,
                env=env,
            )

    def connect(self, timeout=300):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"sidecar exited {self.proc.returncode}: {open(self.log).read()[-2000:]}")
            if os.path.exists(self.sock):
                try:
                    return Checkpointer(socket=self.sock, spawn=False)
                except SidecarError:
                    pass
            if time.monotonic() > deadline:
                raise SystemExit(f"sidecar not ready after {timeout} s")
            time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- limits ----


def fio(dirpath, size_bytes, rw):
    """Sequential O_DIRECT write or read of size_bytes in dirpath: the best of two
    configurations, in seconds; None (and why, on stderr) when fio is missing or fails."""
    if shutil.which("fio") is None:
        log("fio is not installed: no disk limits (apt-get install -y fio)")
        return None
    f = os.path.join(dirpath, f".bench-compare-fio.{os.getpid()}")
    size_bytes = max(4096, size_bytes // 4096 * 4096)

    def bs(n):
        return f"--bs={max(4096, min(n, size_bytes) // 4096 * 4096)}"

    best = None
    try:
        if rw == "read":
            subprocess.run(
                [
                    "fio",
                    "--name=prep",
                    f"--filename={f}",
                    "--rw=write",
                    bs(4 << 20),
                    f"--size={size_bytes}",
                    "--direct=1",
                    "--ioengine=io_uring",
                    "--iodepth=16",
                ],
                check=True,
                capture_output=True,
            )
        for opts in ([bs(4 << 20), "--iodepth=16"], [bs(1 << 20), "--iodepth=64"]):
            out = subprocess.run(
                [
                    "fio",
                    "--name=limit",
                    f"--filename={f}",
                    f"--rw={rw}",
                    f"--size={size_bytes}",
                    "--direct=1",
                    "--ioengine=io_uring",
                    "--end_fsync=1",
                    "--output-format=json",
                ]
                + opts,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            bw = json.loads(out[out.index("{") :])["jobs"][0][rw]["bw_bytes"]
            if bw and (best is None or bw > best):
                best = bw
    except (subprocess.CalledProcessError, ValueError, KeyError) as e:
        detail = getattr(e, "stderr", None) or getattr(e, "stdout", None) or ""
        log(f"fio {rw} failed in {dirpath}: {e} {str(detail).strip()[-300:]}")
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return size_bytes / best if best else None


def memcpy_s(state, dst):
    t0 = time.perf_counter()
    for k, t in state.items():
        ctypes.memmove(dst[k].data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    return time.perf_counter() - t0


# ---- methods: each returns a callable that saves once and returns {stall_s, durable_s, restore_s, ...} ----

# Untimed saves before a timed one of a LoRA-like state (SidecarMethod).
STEADY_SAVES = 3


class SidecarMethod:
    def __init__(self, name, ck, state, shared, steady=None):
        self.name, self.ck, self.state, self.shared = name, ck, state, shared
        self.dummy = {"dummy": torch.zeros(1024)}
        # LoRA-like states (sidecar_copied, sidecar_trust): a callable that
        # makes the state's next step (the adapters' writes). STEADY_SAVES
        # untimed saves of the state come first, each after such a step, so
        # the timed one is the steady state of saving every step (the
        # sidecar's incremental layout learns which tensors change from its
        # last commits, which other methods' saves in between replace), and
        # no restore follows (its untimed tiny save would be the newest
        # commit the next save compares with).
        self.steady = steady

    def __call__(self, step, workdir):
        ck = self.ck
        if self.steady is not None:
            for k in range(STEADY_SAVES):
                ck.save(step + k, self.state).wait_durable()
                self.steady()
            t0 = time.perf_counter()
            h = ck.save(step + STEADY_SAVES, self.state)
            h.wait_released()
            t1 = time.perf_counter()
            h.wait_durable()
            t2 = time.perf_counter()
            return {
                "stall_s": t1 - t0,
                "durable_s": t2 - t0,
                "restore_s": None,
                "trainer_copied_bytes": h.copied_bytes,
                "written_bytes": (ck.status().get("last") or {}).get("bytes"),
            }
        t0 = time.perf_counter()
        h = ck.save(step, self.state)
        h.wait_released()
        t1 = time.perf_counter()
        h.wait_durable()
        t2 = time.perf_counter()
        out = {"stall_s": t1 - t0, "durable_s": t2 - t0}
        # The newest checkpoint stays resident in the sidecar's memory (a load
        # of it is a memory copy): an untimed tiny save takes its place, so the
        # restore of `step` reads the disk, as every other method's does.
        ck.save(step + 1, self.dummy).wait_durable()
        t3 = time.perf_counter()
        got = ck.load(step)
        out["restore_s"] = time.perf_counter() - t3
        out["restore_source"] = ck.last_load_source
        del got
        return out


def torch_save_method(fsync):
    def run(step, state, workdir):
        path = os.path.join(workdir, "state.pt")
        t0 = time.perf_counter()
        if fsync:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(workdir, True)
        else:
            torch.save(state, path)
        t1 = time.perf_counter()
        out = {"stall_s": t1 - t0, "durable_s": (t1 - t0) if fsync else None}
        drop_cache(path)
        t2 = time.perf_counter()
        got = torch.load(path, weights_only=True)
        out["restore_s"] = time.perf_counter() - t2
        del got
        return out

    return run


def safetensors_method(step, state, workdir):
    from safetensors.torch import load_file, save_file

    path = os.path.join(workdir, "state.safetensors")
    t0 = time.perf_counter()
    save_file(state, path)
    fsync_path(path)
    fsync_path(workdir, True)
    t1 = time.perf_counter()
    out = {"stall_s": t1 - t0, "durable_s": t1 - t0}
    drop_cache(path)
    t2 = time.perf_counter()
    got = load_file(path)
    out["restore_s"] = time.perf_counter() - t2
    del got
    return out


class DcpMethod:
    """torch.distributed.checkpoint save / async_save (FileSystemWriter syncs
    its files), in a one-process gloo group; restore: dcp.load into
    preallocated tensors."""

    def __init__(self, asynchronous, state):
        import torch.distributed as dist

        if not dist.is_initialized():
            store = tempfile.mkdtemp(prefix="bench-compare-pg-")
            dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
        self.asynchronous = asynchronous
        # One warm restore target per state, shared by save and async_save.
        cache = DcpMethod.__dict__.get("_targets")
        if cache is None or cache[0] is not state:
            target = {k: torch.empty_like(t) for k, t in state.items()}
            for t in target.values():
                t.zero_()
            DcpMethod._targets = cache = (state, target)
        self.target = cache[1]

    def __call__(self, step, state, workdir):
        import torch.distributed.checkpoint as dcp

        path = os.path.join(workdir, f"dcp-{step}")
        t0 = time.perf_counter()
        if self.asynchronous:
            fut = dcp.async_save(state, checkpoint_id=path)
            t1 = time.perf_counter()
            fut.result()
        else:
            dcp.save(state, checkpoint_id=path)
            t1 = time.perf_counter()
        fsync_path(workdir, True)
        t2 = time.perf_counter()
        out = {"stall_s": t1 - t0, "durable_s": t2 - t0}
        drop_cache(path)
        t3 = time.perf_counter()
        dcp.load(self.target, checkpoint_id=path)
        out["restore_s"] = time.perf_counter() - t3
        shutil.rmtree(path, ignore_errors=True)
        return out


# DeepSpeed's FastPersist as its FastCheckpointEngine configures it by
# default: a 64 MiB I/O buffer, double-buffered (checkpoint "writer"
# io_buffer_size / io_buffer_double), and the aio defaults of its "aio"
# config section (deepspeed/runtime/swap_tensor/constants.py).
DS_IO_BUFFER_BYTES = 64 << 20
DS_AIO = {
    "block_size": 1 << 20,
    "queue_depth": 8,
    "single_submit": False,
    "overlap_events": True,
    "intra_op_parallelism": 1,
}


def _one_line(text, limit=400):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else "..." + text[-limit:]


def _mlock_unavailable(nbytes):
    """None when this process may page-lock nbytes (mlock), else why not.
    DeepSpeed's aio op page-locks its CPU I/O buffers (and its bounce buffers)
    and aborts the process when mlock fails, so this is asked first. The soft
    RLIMIT_MEMLOCK is raised to the hard one when that is below nbytes."""
    import mmap
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < nbytes and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
        except (ValueError, OSError):
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    buf = mmap.mmap(-1, nbytes)
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        addr = ctypes.addressof(anchor)
        if libc.mlock(addr, nbytes) != 0:
            err = ctypes.get_errno()
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
            return (
                f"mlock of DeepSpeed's {nbytes >> 20} MiB I/O buffer failed ({os.strerror(err)}; "
                f"RLIMIT_MEMLOCK {limit}): its aio op page-locks its CPU buffers and aborts when it "
                f"cannot (ulimit -l unlimited, or CAP_IPC_LOCK)"
            )
        libc.munlock(addr, nbytes)
        return None
    finally:
        del anchor
        buf.close()


def deepspeed_unavailable():
    """None when DeepSpeed's FastPersist writer can run here (its async_io and
    utils ops built, JIT the first time, and loaded into this process), else
    exactly what failed: the import, ninja, libaio, page-locking, or the build."""
    try:
        # DeepSpeed's logger writes to the sys.stdout of its import: stderr
        # here, so standard output stays the table and the JSON line.
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401
            from deepspeed.accelerator import get_accelerator
            from deepspeed.io import FastFileWriter, FastFileWriterConfig  # noqa: F401
            from deepspeed.ops.op_builder import AsyncIOBuilder

            get_accelerator()
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"import deepspeed failed ({type(e).__name__}: {_one_line(e)}); pip install deepspeed"
    accel = get_accelerator()._name
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        # pip's ninja (a DeepSpeed dependency) lies beside the interpreter (a
        # venv not activated) or, after pip install --target DIR, in DIR/bin:
        # neither need be on PATH.
        extra = [os.path.dirname(sys.executable)]
        try:
            import ninja

            extra += [ninja.BIN_DIR, os.path.join(os.path.dirname(os.path.dirname(ninja.__file__)), "bin")]
        except Exception:  # noqa: BLE001 - then only the interpreter's folder
            pass
        os.environ["PATH"] = os.pathsep.join([d for d in extra if d] + [os.environ.get("PATH", "")])
    if not is_ninja_available():
        return "ninja is not on PATH: DeepSpeed JIT-builds its async_io op with it (pip install ninja)"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        return (
            f"DeepSpeed's async_io op cannot be built here ({accel} accelerator): libaio's io_submit did "
            f"not compile and link (apt-get install libaio-dev)"
        )
    why = _mlock_unavailable(DS_IO_BUFFER_BYTES)
    if why:
        return why
    why = _load_op("async_io", AsyncIOBuilder, accel)
    if why:
        return why
    # FastFileWriter's constructor loads DeepSpeed's utils op (for its
    # storage-list path, which a patched torch.save calls; the stock
    # torch.save only calls write()). The CPU accelerator has no utils op
    # ("not implemented on CPU backend"): the generic C++ one is built in its
    # place, the op the CUDA accelerator uses; said in the results.
    import deepspeed.io.fast_file_writer as ffw

    try:
        ffw.UtilsBuilder().load(verbose=False)
    except ValueError as e:
        from deepspeed.ops.op_builder.utils import UtilsBuilder as GenericUtilsBuilder

        why = _load_op("utils (generic C++)", GenericUtilsBuilder, accel)
        if why:
            return f"FastFileWriter needs DeepSpeed's utils op: the {accel} accelerator has none ({e}); {why}"
        ffw.UtilsBuilder = GenericUtilsBuilder
        global DEEPSPEED_NOTE
        DEEPSPEED_NOTE = (
            f"the {accel} accelerator has no utils op, which FastFileWriter's constructor loads "
            f"(for a path the stock torch.save never calls): DeepSpeed's generic C++ utils op is "
            f"built and used in its place"
        )
        log(f"deepspeed: {DEEPSPEED_NOTE}")
    except Exception as e:  # noqa: BLE001 - a failed build is the reason
        return f"building DeepSpeed's utils op failed ({accel} accelerator): {type(e).__name__}: {_one_line(e)}"
    return None


# Set by deepspeed_unavailable when the writer runs with something substituted.
DEEPSPEED_NOTE = None


def _load_op(name, builder, accel):
    """Builds (JIT, the first time) and loads one DeepSpeed op; None, or why it failed."""
    t0 = time.perf_counter()
    log(
        f"deepspeed: loading its {name} op ({accel} accelerator; a JIT build takes minutes the first time, "
        f"cached in ~/.cache/torch_extensions after)"
    )
    try:
        builder().load(verbose=False)
    except Exception as e:  # noqa: BLE001 - a failed build is the reason
        return f"building DeepSpeed's {name} op failed ({accel} accelerator): {type(e).__name__}: {_one_line(e)}"
    log(f"deepspeed: {name} op loaded in {time.perf_counter() - t0:.1f} s")
    return None


class DeepSpeedMethod:
    """DeepSpeed's FastPersist writer, as its FastCheckpointEngine saves a
    state: torch.save into a deepspeed.io.FastFileWriter, which opens the file
    O_DIRECT, stages the serialized bytes in a page-locked double buffer and
    writes it with libaio; close() drains the buffers, writes the unaligned
    tail, and fsyncs the file. It is synchronous: the stall is the time to
    durable (plus the folder's fsync, as for every method). One aio handle and
    one I/O buffer for the whole run, as the engine keeps them. Restore:
    torch.load, verified equal to the saved state (the check untimed)."""

    def __init__(self):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.handle = AsyncIOBuilder().load().aio_handle(**DS_AIO)
        # As DeepSpeed's checkpoint writer factory: the accelerator's pinned
        # memory where it has one; on a CPU accelerator (pin_memory is a no-op
        # there) the aio op's own page-locked allocation, else every write
        # would go through a bounce buffer allocated per request.
        buf = get_accelerator().pin_memory(torch.empty(DS_IO_BUFFER_BYTES, dtype=torch.uint8), make_copy=False)
        if not self.handle.is_pinned(buf):
            buf = self.handle.new_cpu_locked_tensor(DS_IO_BUFFER_BYTES, torch.empty(0, dtype=torch.uint8))
        buf.zero_()
        self.buffer = buf

    def save(self, path, state):
        """One FastPersist save of `state` into the new file `path`, durable on return."""
        from deepspeed.io import FastFileWriter, FastFileWriterConfig

        writer = FastFileWriter(
            file_path=path,
            config=FastFileWriterConfig(dnvme_handle=self.handle, pinned_tensor=self.buffer, double_buffer=True),
        )
        torch.save(state, writer)
        writer.close()  # drains, fsyncs and closes the file: the durable point
        fsync_path(os.path.dirname(path), True)

    def __call__(self, step, state, workdir):
        path = os.path.join(workdir, "state.pt")
        t0 = time.perf_counter()
        self.save(path, state)
        t1 = time.perf_counter()
        out = {"stall_s": t1 - t0, "durable_s": t1 - t0}
        drop_cache(path)
        t2 = time.perf_counter()
        got = torch.load(path, weights_only=True)
        out["restore_s"] = time.perf_counter() - t2
        if got.keys() != state.keys():
            raise RuntimeError(f"deepspeed_fastpersist: restored keys differ: {sorted(got.keys() ^ state.keys())[:5]}")
        for k, t in state.items():
            if not torch.equal(got[k], t):
                raise RuntimeError(f"deepspeed_fastpersist: restored tensor {k!r} differs from the saved one")
        out["restore_verified"] = True
        del got
        return out


# ---- the training loop: checkpoint every step, every 10 steps, never ----

# The sidecar runs as a training loop would use it: parameters and moments in
# shared memory (share), the optimizer step guarded.
LOOP_METHODS = [
    "sidecar_shared",
    "torch_save",
    "torch_save_fsync",
    "safetensors_fsync",
    "dcp_save",
    "dcp_async_save",
    "deepspeed_fastpersist",
]


def run_loop(args, base, skipped, drain=None):
    """A small model (an MLP of about --loop-size bytes of parameters, AdamW:
    three times that in state) trained --loop-steps steps, checkpointing every
    step, every 10 steps, and never, through each method. The step: a
    forward/backward of --loop-kind "gpu_like" (a sleep: an accelerator
    computes, the CPU is free) or "cpu" (single-thread matmuls), then the
    real optimizer step on the CPU. The step time is 1.25 x the sidecar's
    persist time (measured first), so a step is longer than a persist.
    Checkpointing loops alternate with plain ones; each is compared with the
    mean of its two neighbours; slowdown in %."""
    import torch.nn as nn

    torch.set_num_threads(1)
    width = 1024
    layers = max(1, args.loop_size // (width * width * 4))
    x = torch.randn(8, width)
    if args.loop_lora:
        # LoRA-like: a frozen MLP, rank-8 adapters per layer, AdamW on the adapters.
        class Lora(nn.Module):
            def __init__(self):
                super().__init__()
                self.base = nn.ModuleList(nn.Linear(width, width).requires_grad_(False) for _ in range(layers))
                self.a = nn.ParameterList(nn.Parameter(torch.randn(width, 8) * 0.01) for _ in range(layers))
                self.b = nn.ParameterList(nn.Parameter(torch.zeros(8, width)) for _ in range(layers))

            def forward(self, y):
                for lin, a, b in zip(self.base, self.a, self.b):
                    y = lin(y) + (y @ a) @ b
                return y

        model = Lora()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    else:
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def fwd_bwd():
        model(x).sum().backward()

    fwd_bwd()
    opt.step()  # AdamW's moments exist from here on
    side = Sidecar(
        os.path.join(base, "loop-ckpt" + ("-drain" if drain else "")), 6 * args.loop_size + (256 << 20), drain=drain
    )
    ck = side.connect()
    try:
        ck.share(model)
        ck.share(opt.state)
        ck.guard(opt)
        if args.loop_lora:
            # sidecar_trust: the same connection and shared tensors, its saves
            # made with incremental="trust-version" (a tracker of its own,
            # swapped in for them): the frozen base is flagged unchanged and
            # the sidecar takes it from its resident image instead of copying
            # it from shared memory.
            from . import _trust

            trust_tracker = _trust.Tracker()

        def state(step):
            return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

        size_b = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
            t.numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        steps = iter(range(1, 10**9))
        persist = []
        for _ in range(3):
            h = ck.save(next(steps), state(0))
            h.wait_durable()
            persist.append(h.figures()["persist_s"] + (h.figures()["copy_s"] or 0))
        step_s = max(0.02, 1.25 * med(persist))
        if args.loop_kind == "cpu":
            a = torch.rand(384, 384)
            t0 = time.perf_counter()
            for _ in range(20):
                a = torch.mm(a, a).clamp_(0, 1)
            n_mm = max(1, int(step_s / ((time.perf_counter() - t0) / 20)))

            def compute():
                y = a
                for _ in range(n_mm):
                    y = torch.mm(y, a).clamp_(0, 1)
                fwd_bwd()
        else:

            def compute():
                time.sleep(step_s)  # the accelerator computes
                fwd_bwd()

        dcp_async = {"fut": None}

        def saver(m):
            wd = os.path.join(base, f"loop-{m}")
            os.makedirs(wd, exist_ok=True)
            if m == "sidecar_shared":
                return lambda st: ck.save(next(steps), st)
            if m == "sidecar_trust":

                def f(st):
                    ck._trust = trust_tracker
                    try:
                        return ck.save(next(steps), st)
                    finally:
                        ck._trust = None

                return f
            if m in ("torch_save", "torch_save_fsync"):

                def f(st):
                    path = os.path.join(wd, "state.pt")
                    if m == "torch_save":
                        torch.save(st, path)
                        return
                    with open(path, "wb") as fh:
                        torch.save(st, fh)
                        fh.flush()
                        os.fsync(fh.fileno())
                    fsync_path(wd, True)

                return f
            if m == "safetensors_fsync":
                from safetensors.torch import save_file

                def f(st):
                    path = os.path.join(wd, "state.safetensors")
                    flat = {f"model.{k}": v for k, v in st["model"].items()}
                    flat.update(
                        {
                            f"optim.{i}.{k}": v
                            for i, s in st["optim"]["state"].items()
                            for k, v in s.items()
                            if isinstance(v, torch.Tensor) and v.dim() > 0
                        }
                    )
                    save_file(flat, path)
                    fsync_path(path)
                    fsync_path(wd, True)

                return f
            if m in ("dcp_save", "dcp_async_save"):
                import torch.distributed as dist
                import torch.distributed.checkpoint as dcp

                if not dist.is_initialized():
                    store = tempfile.mkdtemp(prefix="bench-compare-pg-")
                    dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
                n = iter(range(10**9))

                def f(st):
                    path = os.path.join(wd, f"dcp-{next(n) % 2}")
                    if m == "dcp_save":
                        dcp.save(st, checkpoint_id=path)
                    else:
                        if dcp_async["fut"] is not None:
                            dcp_async["fut"].result()  # one in flight at a time
                        dcp_async["fut"] = dcp.async_save(st, checkpoint_id=path)

                return f
            if m == "deepspeed_fastpersist":
                ds = DeepSpeedMethod()
                n = iter(range(10**9))

                def f(st):
                    # A new file per save, as DeepSpeed's engine writes one per tag.
                    path = os.path.join(wd, f"state-{next(n) % 2}.pt")
                    if os.path.exists(path):
                        os.unlink(path)
                    ds.save(path, st)

                return f
            raise AssertionError(m)

        def loop(save, every):
            compute()  # warm
            t0 = time.perf_counter()
            for i in range(1, args.loop_steps + 1):
                compute()
                opt.step()  # guarded: waits for the release of the last sidecar save
                opt.zero_grad(set_to_none=False)
                if save is not None and i % every == 0:
                    save(state(i))
            total = time.perf_counter() - t0
            if ck._last is not None:
                ck._last.wait_durable()
            if dcp_async["fut"] is not None:
                dcp_async["fut"].result()
                dcp_async["fut"] = None
            return total / args.loop_steps

        loop_methods = LOOP_METHODS + (["sidecar_trust"] if args.loop_lora else [])
        want = [
            m
            for m in (loop_methods if args.methods is None else args.methods.split(","))
            if m in loop_methods and m not in skipped
        ]
        if drain:
            want = ["sidecar_shared"]  # the same loop, its sidecar draining every step to `drain`
        plain = [loop(None, 1)]
        samples = {(m, every): [] for m in want for every in (1, 10)}
        savers = {m: saver(m) for m in want}
        for r in range(args.loop_rounds):
            order = want[r % len(want) :] + want[: r % len(want)]  # rotated between rounds
            for m in order:
                for every in (1, 10):
                    log(
                        f"training loop, round {r + 1}/{args.loop_rounds}: {m}, checkpoint every {every} step(s) "
                        f"({args.loop_steps} steps of {step_s * 1e3:.0f} ms {args.loop_kind} compute)"
                    )
                    t = loop(savers[m], every)
                    plain.append(loop(None, 1))
                    never = (plain[-2] + plain[-1]) / 2
                    samples[(m, every)].append(
                        {"step_s": t, "never_step_s": never, "slowdown_pct": 100 * (t / never - 1)}
                    )
                    log(
                        f"  {m} every {every}: {t * 1e3:.1f} ms/step vs {never * 1e3:.1f} never: "
                        f"{samples[(m, every)][-1]['slowdown_pct']:+.1f} %"
                    )
        rows = [
            {
                "method": m,
                "every": every,
                "rounds": len(v),
                "step_s": med([x["step_s"] for x in v]),
                "never_step_s": med([x["never_step_s"] for x in v]),
                "slowdown_pct": med([x["slowdown_pct"] for x in v]),
                "samples": v,
            }
            for (m, every), v in samples.items()
        ]
        out = {
            "drain": drain,
            "state_bytes": size_b,
            "steps": args.loop_steps,
            "kind": args.loop_kind,
            "step_compute_s": step_s,
            "sidecar_persist_s": med(persist),
            "never_step_s": med(plain),
            "never_runs": plain,
            "rows": rows,
        }
        if args.loop_lora:
            out["lora"] = {
                "frozen_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
                "adapter_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                "unchanged_taken_bytes": ck.status()["unchanged_taken_bytes"],
            }
        return out
    finally:
        ck.close()
        side.stop()


def print_loop(loop):
    print(
        f"training loop: {loop['steps']} steps, {loop['kind']} compute {loop['step_compute_s'] * 1e3:.0f} ms + "
        f"optimizer step; state {loop['state_bytes'] / 2**20:.0f} MiB; sidecar persist "
        f"{loop['sidecar_persist_s'] * 1e3:.0f} ms; never: {loop['never_step_s'] * 1e3:.1f} ms/step"
    )
    if "lora" in loop:
        lo = loop["lora"]
        print(
            f"LoRA-like: frozen {lo['frozen_bytes'] / 2**20:.1f} MiB, adapters {lo['adapter_bytes'] / 2**20:.2f} MiB "
            f"(+ AdamW moments); frozen bytes taken without a copy (trust-version): "
            f"{lo['unchanged_taken_bytes'] / 2**20:.0f} MiB"
        )
    print(
        f"{'method':24s} {'every':>5s} {'ms/step':>9s} {'slowdown':>9s}  (median of {loop['rows'][0]['rounds'] if loop['rows'] else 0} rounds; each round's)"
    )
    for r in loop["rows"]:
        each = " ".join(f"{x['slowdown_pct']:+.1f}" for x in r["samples"])
        print(f"{r['method']:24s} {r['every']:5d} {r['step_s'] * 1e3:9.1f} {r['slowdown_pct']:+8.1f}%  ({each})")


# ---- the run ----


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dir",
        required=True,
        help="directory on the disk to measure (checkpoints and files go in a temp folder inside, removed at the end)",
    )
    p.add_argument("--sizes", default="256MiB", help="comma-separated state sizes, e.g. 256MiB,1GiB,4GiB")
    p.add_argument(
        "--rounds", type=int, default=3, help="timed rounds per size (median); methods rotate between rounds"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (memory warm for every method)")
    p.add_argument("--methods", default=None, help="comma-separated subset of methods (default: all)")
    p.add_argument("--json", action="store_true", help="the JSON document as the last line of stdout")
    p.add_argument(
        "--loop",
        action="store_true",
        help="also the training-loop benchmark (checkpoint every step, every 10, never; each method)",
    )
    p.add_argument("--loop-only", action="store_true", help="only the training-loop benchmark")
    p.add_argument(
        "--drain",
        default=None,
        metavar="URL",
        help="with --loop/--loop-only: run the sidecar's loop again with `serve --drain URL` (every step "
        "uploaded to URL) and print its overhead beside the loop without a drain",
    )
    p.add_argument("--loop-size", type=parse_size, default=32 << 20, help="parameter bytes of the loop's model")
    p.add_argument("--loop-steps", type=int, default=20)
    p.add_argument(
        "--loop-rounds",
        type=int,
        default=3,
        help="rounds of the training loop, methods rotated between rounds; medians (default 3)",
    )
    p.add_argument("--loop-kind", choices=["gpu_like", "cpu"], default="gpu_like")
    p.add_argument(
        "--lora",
        type=parse_size,
        default=None,
        metavar="ADAPTER_SIZE",
        help="LoRA-like states: each size is a frozen base, plus ADAPTER_SIZE of adapters with two AdamW "
        "moments written before every save; adds sidecar_trust and sidecar_changed_only",
    )
    p.add_argument(
        "--loop-lora",
        action="store_true",
        help="the training loop with a frozen model and rank-8 adapters (AdamW on the adapters only); "
        "adds the loop method sidecar_trust",
    )
    p.add_argument("--plot", default=None, help="write a PNG: stall and throughput per method and size (log scales)")
    a = p.parse_args(argv)
    try:
        a.sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if not a.sizes:
        p.error("--sizes: no size given")
    small = [n for n in a.sizes if n < STATE_BYTES_MIN]
    if small:
        p.error(
            f"--sizes: {', '.join(_units.human_bytes(n) for n in small)} is below the smallest state this "
            f"benchmark builds ({_units.human_bytes(STATE_BYTES_MIN)}: 32 norm vectors of 4 KiB)"
        )
    if a.plot is not None:
        why = plot_path_problem(a.plot)
        if why:
            p.error(f"--plot {a.plot}: {why} (checked before the run, so that no run is lost)")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.loop_rounds < 1:
        p.error("--loop-rounds must be at least 1")
    return a


ALL_METHODS = [
    "sidecar_copied",
    "sidecar_shared",
    "torch_save",
    "torch_save_fsync",
    "safetensors_fsync",
    "dcp_save",
    "dcp_async_save",
    "deepspeed_fastpersist",
]
# With --lora only (they need the LoRA-like state).
LORA_METHODS = ["sidecar_trust", "sidecar_changed_only"]


def main(argv=None):
    args = parse_args(argv)
    known = (
        ALL_METHODS
        + (LORA_METHODS if args.lora is not None else [])
        + (["sidecar_trust"] if args.loop_lora and args.lora is None else [])
    )
    want = known if args.methods is None else [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in want if m not in known]
    if unknown:
        raise SystemExit(
            f"bench compare: unknown method(s) {unknown}; known: {known}"
            + ("" if args.lora is not None else f" ({', '.join(LORA_METHODS)} with --lora)")
        )
    os.makedirs(args.dir, exist_ok=True)
    base = tempfile.mkdtemp(prefix="bench-compare-", dir=args.dir)
    skipped = {}
    if "deepspeed_fastpersist" in want:
        why = deepspeed_unavailable()
        if why:
            skipped["deepspeed_fastpersist"] = why
            log(f"skipping deepspeed_fastpersist: {why}")
            want = [m for m in want if m != "deepspeed_fastpersist"]
    results, limits = [], []
    side = ds = None
    if args.loop_only:
        args.sizes = []
    try:
        if args.sizes and any(m.startswith("sidecar") for m in want):
            staging = 2 * max(args.sizes) + (256 << 20)
            log(f"starting the sidecar (staging {staging >> 20} MiB, pre-faulted)")
            # Without --lora the state never changes between rounds: incremental
            # saves would link every shard of the step before and the rows would
            # time a link, not the full write every other method does.
            side = Sidecar(
                os.path.join(base, "sidecar-ckpt"),
                staging,
                extra=() if args.lora is not None else ("--incremental", "off"),
            )
            ck = side.connect()
        step = 0
        ck_trust = None
        if side is not None and args.lora is not None and "sidecar_trust" in want:
            ck_trust = Checkpointer(socket=side.sock, spawn=False, incremental="trust-version")
        for size in args.sizes:
            log(
                f"size {_units.human_bytes(size)}: making the state"
                + (
                    f" (LoRA-like: frozen base + {_units.human_bytes(args.lora)} of adapters, AdamW moments)"
                    if args.lora is not None
                    else ""
                )
            )
            changing = []
            if args.lora is not None:
                state, changing = make_lora_state(size, args.lora)
            else:
                state = make_state(size)
            size_b = nbytes(state)
            shared_state = None
            methods = {}
            for m in want:
                if m == "sidecar_trust":
                    ck_trust.reserve(state)
                    methods[m] = SidecarMethod(m, ck_trust, state, False, steady=lambda: train_adapters(changing))
                    continue
                if m == "sidecar_copied" and args.lora is not None:
                    ck.reserve(state)
                    methods[m] = SidecarMethod(m, ck, state, False, steady=lambda: train_adapters(changing))
                    continue
                if m == "sidecar_changed_only":
                    ck.reserve(state)
                    only = {k: t for k, t in state.items() if not k.startswith("base.")}
                    methods[m] = SidecarMethod(m, ck, only, False)
                    continue
                if m == "sidecar_copied":
                    ck.reserve(state)
                    methods[m] = SidecarMethod(m, ck, state, False)
                elif m == "sidecar_shared":
                    shared_state = ck.share({k: t.clone() for k, t in state.items()})
                    methods[m] = SidecarMethod(m, ck, shared_state, True)
                elif m in ("torch_save", "torch_save_fsync"):
                    fn = torch_save_method(m == "torch_save_fsync")
                    methods[m] = (lambda fn: lambda s, w: fn(s, state, w))(fn)
                elif m == "safetensors_fsync":
                    methods[m] = lambda s, w: safetensors_method(s, state, w)
                elif m in ("dcp_save", "dcp_async_save"):
                    d = DcpMethod(m == "dcp_async_save", state)
                    methods[m] = (lambda d: lambda s, w: d(s, state, w))(d)
                elif m == "deepspeed_fastpersist":
                    ds = ds or DeepSpeedMethod()
                    methods[m] = (lambda ds: lambda s, w: ds(s, state, w))(ds)
            dst = {k: torch.empty_like(t) for k, t in state.items()}
            for t in dst.values():
                t.zero_()
            samples = {m: [] for m in methods}
            lim = {"fio_write_s": [], "fio_read_s": [], "memcpy_s": []}
            names = list(methods)
            total = args.warmup + args.rounds
            for r in range(total):
                timed = r >= args.warmup
                order = names[r % len(names) :] + names[: r % len(names)]  # rotated
                for m in order:
                    step += (
                        2 + STEADY_SAVES
                    )  # a sidecar method also uses step + 1 (a steady one up to step + STEADY_SAVES)
                    workdir = os.path.join(base, f"{m}-{step}")
                    os.makedirs(workdir)
                    log(f"size {_units.human_bytes(size)}, round {r + 1}/{total}{'' if timed else ' (warm-up)'}: {m}")
                    train_adapters(changing)  # LoRA-like: the adapters changed since the last save
                    gc.collect()
                    out = methods[m](step, workdir)
                    shutil.rmtree(workdir, ignore_errors=True)
                    if timed:
                        samples[m].append(out)
                if timed:
                    log(f"size {_units.human_bytes(size)}, round {r + 1}/{total}: fio write/read, memcpy")
                    lim["fio_write_s"].append(fio(base, size_b, "write"))
                    lim["fio_read_s"].append(fio(base, size_b, "read"))
                    lim["memcpy_s"].append(memcpy_s(state, dst))
            entry = {
                "size_bytes": size_b,
                **{k: med(v) for k, v in lim.items()},
                "samples": lim,
                "rounds": args.rounds,
                "memory": "warm",
            }
            limits.append(entry)
            for m, outs in samples.items():
                # sidecar_changed_only saves the changed tensors alone: its
                # throughput is of its own bytes (the row stays under the size).
                row_b = nbytes(methods[m].state) if m == "sidecar_changed_only" else size_b
                row = {
                    "method": m,
                    "size_bytes": size_b,
                    "saved_bytes": row_b,
                    "stall_s": med([o["stall_s"] for o in outs]),
                    "durable_s": med([o.get("durable_s") for o in outs]),
                    "restore_s": med([o.get("restore_s") for o in outs]),
                    "rounds": len(outs),
                    "memory": "warm",
                    "samples": outs,
                }
                if row["durable_s"] and entry["fio_write_s"]:
                    row["durable_over_fio_write"] = row["durable_s"] / entry["fio_write_s"]
                if row["restore_s"] and entry["fio_read_s"]:
                    row["restore_over_fio_read"] = row["restore_s"] / entry["fio_read_s"]
                row["gb_per_s"] = row_b / row["durable_s"] / 1e9 if row["durable_s"] else None
                if args.lora is not None:
                    row["lora_adapter_bytes"] = args.lora
                if m in ("sidecar_trust", "sidecar_copied") and args.lora is not None:
                    row["trainer_copied_bytes"] = med([o.get("trainer_copied_bytes") for o in outs])
                    row["written_bytes"] = med([o.get("written_bytes") for o in outs])
                if m == "deepspeed_fastpersist" and DEEPSPEED_NOTE:
                    row["note"] = DEEPSPEED_NOTE
                results.append(row)
            del state, shared_state, dst, methods
            DcpMethod._targets = None
            gc.collect()
        if side is not None:
            if ck_trust is not None:
                ck_trust.close()
            ck.close()
            side.stop()
            side = None
        loop = run_loop(args, base, skipped) if args.loop or args.loop_only else None
        loop_drain = run_loop(args, base, skipped, drain=args.drain) if loop is not None and args.drain else None
    finally:
        if side is not None:
            try:
                ck.close()
            except Exception:  # noqa: BLE001 - stopping it is what matters now
                pass
            side.stop()
        shutil.rmtree(base, ignore_errors=True)

    doc = {
        "results": results,
        "limits": limits,
        "skipped": skipped,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "dir": os.path.abspath(args.dir)},
        "notes": "medians; memory warm for every method (states, targets and the sidecar's staging touched "
        "before timing, plus untimed warm-up rounds); methods rotated between rounds; stall: until the "
        "trainer may change its tensors (sidecar_shared: save() + wait_released, without overlapping "
        "the wait with compute); durable: synced to disk (torch_save: never, null); restore: from disk "
        "(page cache dropped; the sidecar loads the checkpoint before its resident newest one)",
    }
    if loop is not None:
        doc["loop"] = loop
    if loop_drain is not None:
        doc["loop_drain"] = loop_drain
    if results:
        print_table(doc)
    if loop is not None:
        print_loop(loop)
    if loop_drain is not None:
        print(f"with --drain {loop_drain['drain']}:")
        print_loop(loop_drain)
    plot_failed = None
    if args.plot and results:
        try:
            plot(doc, args.plot)
            log(f"wrote {args.plot}")
        except Exception as e:  # noqa: BLE001 - the figures (and --json) are not lost for a picture
            plot_failed = f"bench compare: --plot {args.plot}: writing the plot failed: {type(e).__name__}: {e}"
            log(plot_failed)
    if args.json:
        print(json.dumps(doc), flush=True)
    if plot_failed:
        raise SystemExit(plot_failed)


def plot_path_problem(path):
    """Why a PNG cannot be written at `path` (a directory there, a missing
    or unwritable folder, a file there that cannot be written, a file format
    matplotlib does not write), else None. The folder is probed by creating
    (and removing) a file in it; `path` itself is not created."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(d):
        return f"no folder {d}"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "exists and is not writable"
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".bench-compare-plot-probe-"):
            pass
    except OSError as e:
        return f"cannot create a file in {d}: {e.strerror or e}"
    ext = os.path.splitext(path)[1][1:].lower()
    if ext:
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            known = FigureCanvasAgg(Figure()).get_supported_filetypes()
        except ImportError as e:
            return f"matplotlib, which draws it, does not import ({e})"
        if ext not in known:
            return f"matplotlib writes no .{ext} file (it writes {', '.join(sorted(known))})"
    return None


def fmt(x, unit=""):
    return "-" if x is None else f"{x:.4f}{unit}"


def print_table(doc):
    lims = {e["size_bytes"]: e for e in doc["limits"]}
    print(
        f"{'method':24s} {'size':>9s} {'stall s':>9s} {'durable s':>10s} {'GB/s':>7s} {'÷ fio':>6s} {'restore s':>10s}"
    )
    for r in doc["results"]:
        lim = lims[r["size_bytes"]]
        ratio = r["durable_s"] / lim["fio_write_s"] if r["durable_s"] and lim["fio_write_s"] else None
        gbs = r["gb_per_s"]
        print(
            f"{r['method']:24s} {_units.human_bytes(r['size_bytes']):>9s} {fmt(r['stall_s']):>9s} {fmt(r['durable_s']):>10s} "
            f"{'-' if gbs is None else f'{gbs:.2f}':>7s} {'-' if ratio is None else f'{ratio:.2f}':>6s} "
            f"{fmt(r['restore_s']):>10s}"
        )
    for e in doc["limits"]:
        print(
            f"{'limit: fio write':24s} {_units.human_bytes(e['size_bytes']):>9s} {'':>9s} {fmt(e['fio_write_s']):>10s}"
        )
        print(
            f"{'limit: fio read':24s} {_units.human_bytes(e['size_bytes']):>9s} {'':>9s} {'':>10s} {'':>7s} {'':>6s} "
            f"{fmt(e['fio_read_s']):>10s}"
        )
        print(f"{'limit: memcpy':24s} {_units.human_bytes(e['size_bytes']):>9s} {fmt(e['memcpy_s']):>9s}")
    for m, note in {r["method"]: r["note"] for r in doc["results"] if r.get("note")}.items():
        print(f"{m}: note: {note}")
    for m, why in doc.get("skipped", {}).items():
        print(f"{m}: skipped ({why})")


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in doc["results"]))
    sizes = [e["size_bytes"] for e in doc["limits"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(methods):
        c = colors[i % len(colors)]  # one colour per method in both panels
        rows = sorted((r for r in doc["results"] if r["method"] == m), key=lambda r: r["size_bytes"])
        xs = [r["size_bytes"] / 2**20 for r in rows]
        a1.plot(xs, [r["stall_s"] for r in rows], marker="o", color=c, label=m)
        tp = [(x, r["size_bytes"] / r["durable_s"] / 2**30) for x, r in zip(xs, rows) if r["durable_s"]]
        if tp:
            a2.plot([t[0] for t in tp], [t[1] for t in tp], marker="o", color=c, label=m)
    xs = [s / 2**20 for s in sizes]
    a1.plot(xs, [e["memcpy_s"] for e in doc["limits"]], "k--", label="memcpy (limit)")
    fio_tp = [(x, e["size_bytes"] / e["fio_write_s"] / 2**30) for x, e in zip(xs, doc["limits"]) if e["fio_write_s"]]
    if fio_tp:
        a2.plot([t[0] for t in fio_tp], [t[1] for t in fio_tp], "k--", linewidth=2, label="fio O_DIRECT write (limit)")
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xticks(xs, [_units.human_bytes(n) for n in sizes])
        a.minorticks_off()
        a.set_xlabel("state size")
        a.grid(True, which="both", alpha=0.3)
    a1.set_ylabel("trainer stall per save (s)")
    a1.set_title("stall (lower is better)")
    a2.set_ylabel("throughput to durable (GiB/s)")
    a2.set_title("save → durable throughput (higher is better)")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
