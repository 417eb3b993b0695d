"""The CUDA path from Python, through the test-only fake driver (libcuda.so.1
on host memory, built by `cargo build` into target/<profile>/fake-cuda/):
an object exposing `__cuda_array_interface__` (memory from cuMemAlloc_v2, two
views into one allocation, one at an offset, written by a late async copy
on the stream its interface names) is saved by Checkpointer with a spawned
sidecar, loaded back equal with map_location="cpu", its bytes are in the
committed shard, and `load_into` restores it into fresh device memory.

The trainer runs in a child process: the fake is found through
LD_LIBRARY_PATH like a real driver, and the dynamic loader reads that
variable only when a process starts. These tests fail, never skip, when the
fake is not built.
"""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from ckpt_test_util import fake_cuda_script

from ckpt_sidecar import _native

REPO = pathlib.Path(__file__).resolve().parents[2]


def fake_dir():
    """The folder of the fake libcuda.so.1: beside the sidecar binary the
    tests use ($CKPT_SIDECAR_BIN), else in this checkout's target/release."""
    cands = []
    if os.environ.get("CKPT_SIDECAR_BIN"):
        cands.append(pathlib.Path(os.environ["CKPT_SIDECAR_BIN"]).parent / "fake-cuda")
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    cands.append(target / "release" / "fake-cuda")
    for c in cands:
        if (c / "libcuda.so.1").exists():
            return c
    pytest.fail(f"the fake CUDA driver is not built (looked in {[str(c) for c in cands]}): "
                "cargo build --release --workspace")


TRAINER = fake_cuda_script(r"""
    import ctypes, json, os, sys
    import numpy as np
    import ckpt_sidecar as cs

    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=2000)
    base = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(1 << 20)), "cuMemAlloc_v2")


    w = (np.arange(1000, dtype=np.float32) * 0.5 - 7).astype("<f4")
    b = np.arange(64 * 64, dtype="<i8").reshape(64, 64) * 3 - 5
    old = np.zeros(1 << 20, np.uint8)
    ok(cu.cuMemcpyHtoD_v2(base, old.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(old.nbytes)), "cuMemcpyHtoD")
    # The values to save arrive by async copies the fake driver finishes late:
    # only the sidecar's wait on the event recorded on `stream` makes the
    # checkpoint hold them.
    OFF = 8192
    ck = cs.Checkpointer(dir=sys.argv[1], staging="64MiB")
    assert ck.list() == []  # the spawned sidecar answers before the late writes are queued
    ok(cu.cuMemcpyHtoDAsync_v2(base, w.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(w.nbytes), stream), "w")
    ok(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(base.value + OFF), b.ctypes.data_as(ctypes.c_void_p),
                               ctypes.c_size_t(b.nbytes), stream), "b")
    state = {"model": {"w": DeviceArray(base.value, (1000,), "<f4", stream.value),
                       "b": DeviceArray(base.value + OFF, (64, 64), "<i8", stream.value)},
             "step": 7}
    h = ck.save(7, state)
    h.wait_durable(timeout=120)
    back = ck.load(7, map_location="cpu")
    assert isinstance(back["model"]["w"], np.ndarray) and back["step"] == 7, back
    assert back["model"]["w"].dtype == np.float32 and np.array_equal(back["model"]["w"], w), back["model"]["w"][:8]
    assert back["model"]["b"].shape == (64, 64) and np.array_equal(back["model"]["b"], b)
    # Restore to device memory: the sidecar writes straight into a fresh
    # allocation (other offsets), checked by reading the device back.
    fresh = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(fresh), ctypes.c_size_t(1 << 20)), "cuMemAlloc_v2")
    target = {"model": {"w": DeviceArray(fresh.value + 4096, (1000,), "<f4", None),
                        "b": DeviceArray(fresh.value + 65536, (64, 64), "<i8", None)}, "step": 0}
    assert ck.load_into(target, 7) == 7
    got_w, got_b = np.empty_like(w), np.empty_like(b)
    ok(cu.cuMemcpyDtoH_v2(got_w.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(fresh.value + 4096), ctypes.c_size_t(w.nbytes)), "w back")
    ok(cu.cuMemcpyDtoH_v2(got_b.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(fresh.value + 65536), ctypes.c_size_t(b.nbytes)), "b back")
    assert np.array_equal(got_w, w) and np.array_equal(got_b, b), "restore to device memory differs"
    ck.close()
    ok(cu.cuMemFree_v2(fresh), "cuMemFree")
    ok(cu.cuStreamSynchronize(stream), "sync")
    ok(cu.cuMemFree_v2(base), "cuMemFree")
    print(json.dumps({"ok": True, "w": w.tobytes().hex()[:64]}))
""")


def stream_waits_refused():
    """Whether this run's fake refuses stream waits (CKPT_FAKE_CUDA_REFUSE)."""
    return "stream_wait" in [r.strip() for r in os.environ.get("CKPT_FAKE_CUDA_REFUSE", "").split(",")]


def run_trainer(tmp_path, delay_us):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    return run_script(tmp_path, script, delay_us)


def run_script(tmp_path, script, delay_us, extra_env=None):
    """Runs a trainer script with the fake driver on its search path, its own
    device copies late by `delay_us`, and checkpoints in tmp_path/ck."""
    env = dict(os.environ)
    env.update(extra_env or {})
    env["LD_LIBRARY_PATH"] = str(fake_dir())
    env["FAKE_CUDA_COPY_DELAY_US"] = str(delay_us)
    # The child imports the very package this test imported.
    import ckpt_sidecar
    pkg_parent = str(pathlib.Path(ckpt_sidecar.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
        # Fake device memory a failed trainer did not free.
        for pattern in (f"fakecuda-{proc.pid}-*", f"fakecuda-ev-{proc.pid}-*"):
            for f in pathlib.Path("/dev/shm").glob(pattern):
                f.unlink(missing_ok=True)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_script_json(tmp_path, name, code, delay_us, extra_env=None):
    """run_script of `code` written to tmp_path/name, which must exit 0; the
    JSON object its last line of stdout prints."""
    script = tmp_path / name
    script.write_text(code)
    r = run_script(tmp_path, script, delay_us, extra_env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cuda_array_interface_objects_are_saved_from_the_device_and_load_back_equal(tmp_path):
    import numpy as np
    from safetensors.numpy import load_file

    r = run_trainer(tmp_path, 1_000_000)
    assert r.returncode == 0 and '"ok": true' in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    # The bytes are in the committed shard, read by the official library.
    steps = sorted((tmp_path / "ck").glob("step-*7"))
    assert steps, list((tmp_path / "ck").iterdir())
    tensors = {}
    for shard in steps[-1].rglob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    w = (np.arange(1000, dtype=np.float32) * 0.5 - 7)
    b = np.arange(64 * 64, dtype=np.int64).reshape(64, 64) * 3 - 5
    assert np.array_equal(tensors["model.w"], w)
    assert np.array_equal(tensors["model.b"], b)
    verify = subprocess.run([_native.sidecar_binary(), "verify", str(tmp_path / "ck")], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_doctor_reports_the_fake_device_and_no_driver_without_it(tmp_path):
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    plain = subprocess.run([_native.sidecar_binary(), "doctor", str(tmp_path), "--json"], env=env,
                           capture_output=True, text=True)
    assert json.loads(plain.stdout)["cuda"] == {"available": False,
                                                "error": "no CUDA driver (libcuda.so.1 is not on the library search path)"}
    env["LD_LIBRARY_PATH"] = str(fake_dir())
    fake = subprocess.run([_native.sidecar_binary(), "doctor", str(tmp_path), "--json"], env=env,
                          capture_output=True, text=True)
    cuda = json.loads(fake.stdout)["cuda"]
    assert cuda["available"] is True and "fake CUDA device" in cuda["devices"][0]["name"], cuda


def test_without_a_driver_a_device_object_is_refused_clearly(sidecar):
    """This test process has no driver (CI): a __cuda_array_interface__ object
    is refused with the reason, and host state still saves. (With a real
    driver, the bogus address is refused as no device memory.)"""
    import numpy as np
    import ckpt_sidecar as cs

    driver = _native.lib().ckpt_cuda_probe() == 0

    class DeviceArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x7000_0000, False), "version": 3,
                                    "strides": None, "stream": None}

    with cs.Checkpointer(dir=str(sidecar.dir), socket=sidecar.socket, spawn=False) as ck:
        with pytest.raises(cs.CudaError, match="not CUDA device memory" if driver else "no CUDA driver"):
            ck.save(1, {"d": DeviceArray()})
        ck.save(2, {"h": np.ones(4, np.float32)}).wait_durable(timeout=60)
        assert np.array_equal(ck.load(2)["h"], np.ones(4, np.float32))


GUARD_TRAINER = fake_cuda_script(r"""
    import ctypes, json, os, sys, time
    import numpy as np
    import torch
    import ckpt_sidecar as cs

    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=1500000)
    N = 1 << 18
    base = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(4 * N)), "cuMemAlloc_v2")
    saved = np.arange(N, dtype="<f4") * 0.25
    step_writes = -saved
    ok(cu.cuMemcpyHtoD_v2(base, saved.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(saved.nbytes)), "fill")


    ck = cs.Checkpointer(dir=sys.argv[1], staging="64MiB")
    assert ck.list() == []
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(4)
    ck.guard(opt)
    h = ck.save(3, {"w": DeviceArray(base.value, (N,), "<f4", stream.value)})
    assert h.cuda_stream == stream.value
    opt.step()  # the guard: the save's stream waits on the sidecar's copy, the CPU does not
    state_after_hook = h.state()
    # The optimizer step's write to the saved tensor, queued at once on that stream.
    ok(cu.cuMemcpyHtoDAsync_v2(base, step_writes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(step_writes.nbytes),
                               stream), "step write")
    h.wait_durable(timeout=120)
    back = ck.load(3, map_location="cpu")["w"]
    ok(cu.cuStreamSynchronize(stream), "sync")
    now = np.empty_like(saved)
    ok(cu.cuMemcpyDtoH_v2(now.ctypes.data_as(ctypes.c_void_p), base, ctypes.c_size_t(now.nbytes)), "read back")
    ck.close()
    ok(cu.cuMemFree_v2(base), "cuMemFree")
    print(json.dumps({"state_after_hook": state_after_hook, "snapshot_is_saved": bool(np.array_equal(back, saved)),
                      "device_has_step": bool(np.array_equal(now, step_writes))}))
""")


def test_guard_makes_the_next_step_wait_on_the_copy_on_its_stream_not_the_cpu(tmp_path):
    """guard(optimizer) for a save of device tensors: the step's write, queued
    right after optimizer.step() on the save's stream, stays out of the
    snapshot, though the hook returned while the sidecar was still copying
    (its copies are 1.5 s late): the wait was the stream's, not the CPU's."""
    got = run_script_json(tmp_path, "guard.py", GUARD_TRAINER, 2_000)
    if stream_waits_refused():
        # This run's fake refuses stream waits: the hook waited on the CPU.
        assert got["state_after_hook"] in ("released", "durable"), got
        assert got["snapshot_is_saved"] and got["device_has_step"], got
    else:
        assert got == {"state_after_hook": "pending", "snapshot_is_saved": True, "device_has_step": True}, got


def test_guard_waits_on_the_cpu_when_the_driver_refuses_the_stream_wait(tmp_path):
    """A driver without stream memory operations (cuStreamWaitValue32:
    NOT_SUPPORTED): guard(optimizer) makes the step wait for Released on the
    CPU, so the step's write stays out of the snapshot. Before, the refusal
    only warned and the step ran while the sidecar still copied."""
    refuse = {"CKPT_FAKE_CUDA_REFUSE": "stream_wait,devptr_without_devicemap"}
    got = run_script_json(tmp_path, "guard.py", GUARD_TRAINER, 2_000, refuse)
    assert got["state_after_hook"] in ("released", "durable"), got
    assert got["snapshot_is_saved"] and got["device_has_step"], got


REALLOC = fake_cuda_script(r"""
    import ctypes, json, os, sys
    import numpy as np
    import ckpt_sidecar as cs

    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=2000)
    stats = os.environ["FAKE_CUDA_STATS_DIR"]



    N = 1 << 20
    ck = cs.Checkpointer(dir=sys.argv[1], staging="64MiB")
    want, addrs = [], []
    base = ctypes.c_uint64()
    for step in (1, 2):
        if step == 2:
            ok(cu.cuMemFree_v2(base), "cuMemFree")
        ok(cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(N)), "cuMemAlloc_v2")
        addrs.append(base.value)
        v = (np.arange(N // 4, dtype="<u4") * (7 + step)).astype("<u4")
        want.append(v)
        # Written late on `stream`: each save waits on its event.
        ok(cu.cuMemcpyHtoDAsync_v2(base, v.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(N), stream), "write")
        ck.save(step, {"x": DeviceArray(base.value, (N // 4,), "<u4", stream.value)}).wait_durable(timeout=120)
    assert addrs[0] == addrs[1], f"the fake did not reuse the freed address: {addrs}"
    opened, total = sidecar_stat(stats, "imports_open"), sidecar_stat(stats, "imports_total")
    for step in (1, 2):
        got = ck.load(step, map_location="cpu")["x"]
        assert np.array_equal(got, want[step - 1]), f"step {step} does not hold the bytes of its own allocation"
    ck.close()
    ok(cu.cuStreamSynchronize(stream), "sync")
    ok(cu.cuMemFree_v2(base), "cuMemFree")
    print(json.dumps({"ok": True, "imports_open": opened, "imports_total": total}))
""")


def test_memory_freed_and_allocated_again_at_the_same_address_is_saved_anew_and_the_old_import_closed(tmp_path):
    script = tmp_path / "realloc.py"
    script.write_text(REALLOC)
    stats = tmp_path / "stats"
    stats.mkdir()
    os.environ["FAKE_CUDA_STATS_DIR"] = str(stats)
    try:
        r = run_script(tmp_path, script, 300_000)
    finally:
        del os.environ["FAKE_CUDA_STATS_DIR"]
    assert r.returncode == 0 and '"ok": true' in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # Two allocations at one address, each opened at registration (to check
    # it) and for its save, and closed again each time: no legacy import
    # outlives its request (the trainer may free the memory at any time).
    assert (got["imports_open"], got["imports_total"]) == (0, 4), got


STRICT = textwrap.dedent(r"""
    import ctypes, json, os, sys
    cu = ctypes.CDLL("libcuda.so.1")
    out = {}
    out["init"] = cu.cuInit(0)
    n = ctypes.c_int()
    cu.cuDeviceGetCount(ctypes.byref(n))
    out["count"] = n.value
    uuids = []
    for i in range(n.value):
        u = (ctypes.c_char * 16)()
        assert cu.cuDeviceGetUuid_v2(u, i) == 0
        uuids.append(bytes(u).hex())
    out["uuids"] = uuids
    p = ctypes.c_uint64()
    # No context current on this thread: 201.
    out["alloc_without_context"] = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4096))
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
    assert cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4096)) == 0
    class Handle(ctypes.Structure):  # CUipcMemHandle, passed by value
        _fields_ = [("reserved", ctypes.c_char * 64)]
    h = Handle()
    assert cu.cuIpcGetMemHandle(ctypes.byref(h), p) == 0
    q = ctypes.c_uint64()
    # A handle exported by this very process cannot be opened here.
    out["open_own_handle"] = cu.cuIpcOpenMemHandle_v2(ctypes.byref(q), h, 1)
    print(json.dumps(out))
""")


def run_strict(tmp_path, env_extra):
    script = tmp_path / "strict.py"
    script.write_text(STRICT)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(fake_dir())
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(env_extra)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_fake_driver_is_as_strict_as_the_real_one_on_contexts_own_handles_and_visible_devices(tmp_path):
    both = run_strict(tmp_path, {"CKPT_FAKE_CUDA_DEVICES": "2"})
    assert both["count"] == 2 and len(set(both["uuids"])) == 2, both
    assert both["alloc_without_context"] == 201, both
    assert both["open_own_handle"] != 0, both
    one = run_strict(tmp_path, {"CKPT_FAKE_CUDA_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "1"})
    # Device 1 alone: ordinal 0 here, with device 1's UUID.
    assert one["count"] == 1 and one["uuids"] == [both["uuids"][1]], (one, both)


NO_CONTEXT_THREAD = fake_cuda_script(r"""
    import ctypes, json, os, sys, threading
    import numpy as np
    import ckpt_sidecar as cs

    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=2000)
    base = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(1 << 16)), "cuMemAlloc_v2")
    v = np.arange(1 << 14, dtype="<u4")
    ok(cu.cuMemcpyHtoD_v2(base, v.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(v.nbytes)), "fill")


    ck = cs.Checkpointer(dir=sys.argv[1], staging="64MiB")
    # Two views that overlap: the second cannot be described in place and is
    # copied to the host by the shim, on a thread that has no CUDA context.
    state = {"a": DeviceArray(base.value, (1 << 14,), "<u4"), "b": DeviceArray(base.value + 64, (16,), "<u4")}
    err = []
    def save():
        try:
            ck.save(1, state).wait_durable(timeout=120)
        except Exception as e:
            err.append(repr(e))
    t = threading.Thread(target=save)
    t.start()
    t.join()
    back = ck.load(1, map_location="cpu") if not err else None
    ck.close()
    print(json.dumps({"err": err, "a": bool(back is not None and np.array_equal(back["a"], v)),
                      "b": bool(back is not None and np.array_equal(back["b"], v[16:32]))}))
""")


def test_a_device_leaf_copied_by_the_shim_on_a_thread_with_no_cuda_context_is_copied_in_its_devices_context(tmp_path):
    got = run_script_json(tmp_path, "noctx.py", NO_CONTEXT_THREAD, 2_000)
    assert got == {"err": [], "a": True, "b": True}, got


ASYNC_POOL = fake_cuda_script(r"""
    import ctypes, json, os, sys
    import numpy as np
    import ckpt_sidecar as cs

    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=2000)
    p = ctypes.c_uint64()
    ok(cu.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(1 << 16), stream), "cuMemAllocAsync")

    class DeviceArray:
        def __init__(self, ptr):
            self.__cuda_array_interface__ = {"shape": (1 << 14,), "typestr": "<f4", "data": (ptr, False),
                                             "strides": None, "version": 3, "stream": None}

    ck = cs.Checkpointer(dir=sys.argv[1], staging="64MiB")
    try:
        ck.save(1, {"x": DeviceArray(p.value)})
        print(json.dumps({"error": None}))
    except cs.CudaError as e:
        print(json.dumps({"error": str(e)}))
    ck.close()
""")


def test_memory_of_a_stream_ordered_pool_is_refused_naming_cudamallocasync(tmp_path):
    got = run_script_json(tmp_path, "pool.py", ASYNC_POOL, 2_000)
    assert got["error"] and "cudaMallocAsync" in got["error"] and "backend:cudaMallocAsync" in got["error"], got


DCP_ASYNC_STAGE = fake_cuda_script(r"""
    import ctypes, json, os, sys, threading
    import numpy as np
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
    from torch.distributed.checkpoint.staging import AsyncStager
    import ckpt_sidecar as cs
    from ckpt_sidecar.dcp import SidecarWriter

    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=1500000)
    stats = os.environ["FAKE_CUDA_STATS_DIR"]
    N = 1 << 18
    base = ctypes.c_uint64()
    ok(cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(4 * N)), "cuMemAlloc_v2")
    saved = np.arange(N, dtype="<f4") * 0.5
    next_step = -saved
    ok(cu.cuMemcpyHtoD_v2(base, saved.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(saved.nbytes)), "fill")



    class Planner:
        # What DCP's planner hands write_data: each item's data from the staged state.
        def __init__(self, staged):
            self.staged = staged
        def resolve_data(self, item):
            return self.staged[item.index.fqn]

    w = SidecarWriter(sys.argv[1], step=5, staging="64MiB")
    dev_leaf, host = DeviceArray(base.value, (N,), "<f4", stream.value), torch.arange(16, dtype=torch.float32)
    state = {"w": dev_leaf, "bias": host}
    out = {"is_async_stager": isinstance(w, AsyncStager)}
    # async_save's order: stage on the trainer's thread, the save on DCP's
    # background thread, synchronize_staging on the trainer's thread.
    staged = w.stage(state)
    out["device_leaf_kept"] = staged["w"] is dev_leaf
    out["host_copied"] = staged["bias"] is not host and bool(torch.equal(staged["bias"], host))
    out["synchronize"] = w.should_synchronize_after_execute
    err = []

    def background():
        try:
            w.reset()
            w.set_up_storage_writer(True)
            items = [WriteItem(index=MetadataIndex(k), type=WriteItemType.TENSOR) for k in ("w", "bias")]
            plans = w.prepare_global_plan([w.prepare_local_plan(SavePlan(items))])
            results = w.write_data(plans[0], Planner(staged)).wait()
            w.finish(Metadata(state_dict_metadata={}), [results])
        except Exception as e:
            err.append(repr(e))

    t = threading.Thread(target=background)
    t.start()
    w.synchronize_staging()
    h = w._checkpointer()._last
    # The CPU did not wait for the sidecar's copy (1.5 s late): the stream does.
    out["state_after_synchronize"] = h.state() if h is not None else None
    host.add_(1000.0)
    # The next step's write to the staged tensor, queued at once on the trainer's stream.
    ok(cu.cuMemcpyHtoDAsync_v2(base, next_step.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(next_step.nbytes),
                               stream), "next step")
    t.join()
    out["err"] = err
    back = w._checkpointer().load(5, map_location="cpu")
    out["device_snapshot_is_staged"] = bool(np.array_equal(np.asarray(back["w"]), saved))
    out["host_snapshot_is_staged"] = bool(np.array_equal(np.asarray(back["bias"]), np.arange(16, dtype=np.float32)))
    out["sidecar_imports_total"] = sidecar_stat(stats, "imports_total")
    ok(cu.cuStreamSynchronize(stream), "sync")
    now = np.empty_like(saved)
    ok(cu.cuMemcpyDtoH_v2(now.ctypes.data_as(ctypes.c_void_p), base, ctypes.c_size_t(now.nbytes)), "read back")
    out["device_has_next_step"] = bool(np.array_equal(now, next_step))
    w.close()
    ok(cu.cuMemFree_v2(base), "cuMemFree")
    print(json.dumps(out))
""")


def test_dcp_async_save_stages_device_tensors_by_the_sidecars_copy_not_a_trainer_side_host_copy(tmp_path):
    """SidecarWriter as async_save's stager, driven in async_save's order
    (torch's own CUDA cannot run on the fake driver): stage keeps the device
    leaf itself (no host copy by the trainer) and copies host tensors;
    synchronize_staging returns while the sidecar's copy (1.5 s late) is
    still pending; the next step's write queued on the trainer's stream
    right after stays out of the checkpoint, which the sidecar copied from
    the trainer's allocation (its import)."""
    stats = tmp_path / "stats"
    stats.mkdir()
    os.environ["FAKE_CUDA_STATS_DIR"] = str(stats)
    try:
        got = run_script_json(tmp_path, "dcp_stage.py", DCP_ASYNC_STAGE, 2_000)
    finally:
        del os.environ["FAKE_CUDA_STATS_DIR"]
    assert got.pop("sidecar_imports_total", 0) >= 1, got
    # Where this run's fake refuses stream waits, the CPU waited instead.
    state = got.pop("state_after_synchronize")
    assert state in (("released", "durable") if stream_waits_refused() else ("pending",)), state
    assert got == {"is_async_stager": True, "device_leaf_kept": True, "host_copied": True, "synchronize": True,
                   "err": [], "device_snapshot_is_staged": True,
                   "host_snapshot_is_staged": True, "device_has_next_step": True}, got
