"""The methods bench compare measures, each saving the same state once per
call and returning {stall_s, durable_s, restore_s, ...}: the sidecar (a
`ckpt-sidecar serve` of its own: copied or shared tensors, trust-version),
torch.save (with and without fsync), safetensors, torch.distributed.checkpoint
(save and async_save), and DeepSpeed's FastPersist writer where it builds."""

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from . import _native
from ._bench_limits import drop_cache, fsync_path
from ._bench_state import log
from .checkpointer import Checkpointer
from .errors import ConnectFailed, SidecarError


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
                except ConnectFailed:
                    pass  # not listening yet
                except SidecarError as e:
                    # Refused (another protocol version) or worse: waiting cannot mend it.
                    self.stop()
                    raise SystemExit(f"sidecar {self.sock}: {type(e).__name__}: {e}") from e
            if time.monotonic() > deadline:
                self.stop()
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
