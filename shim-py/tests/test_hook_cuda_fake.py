"""The torch.save hook's CUDA way, through the test-only fake driver and a
spawned sidecar: torch here makes no CUDA tensors, so the one function that
says where a storage's bytes are (_hook._device_storage) is substituted:
each chosen CPU storage's bytes are mirrored in fake device memory (written
by late async copies on a stream: only the sidecar's wait on the event the
hook records there makes the file hold them), and everything else runs as on
a GPU: skip_data skeleton, device pieces in registered allocations, the
sidecar's copy on its own stream, its CRC-32s.

The file must be byte-identical to the original torch.save of the same
object (into a file object: the hook's archive is named "archive", as
torch.save names it for a file object), and load equal. Also: a refusal
before Released falls back to the host way and writes the file;
CKPT_SIDECAR_HOOK_CUDA=host keeps the host way; a file the sidecar fails
after Released falls back to the host way inside torch.save; the file is
in place when torch.save returns.
Trainers run in child processes (the fake is found through LD_LIBRARY_PATH,
read when a process starts); these tests fail, never skip, without the fake
or torch's skip_data.
"""
import os
import pathlib
import subprocess
import sys

import pytest
from ckpt_test_util import fake_cuda_script

from test_cuda_fake import fake_dir

torch = pytest.importorskip("torch")

TRAINER = fake_cuda_script(r"""
    import collections, ctypes, io, json, os, random, sys, time, types
    import numpy as np
    import torch
    from ckpt_sidecar import _hook

    mode, out = sys.argv[1], sys.argv[2]
    assert hasattr(torch.serialization, "skip_data"), "this torch has no skip_data"
    {FAKE_CUDA_CONTEXT}
    cu, ok, dev, ctx, stream = fake_cuda_context(sidecar_copy_delay_us=2000)

    mirror = {}  # CPU storage address -> its device copy's address
    allocs = []
    def on_device(t, late=True):
        # t's storage, in fake device memory: zeros first, then its bytes by
        # an async copy the fake finishes late (only the event orders it).
        s = t.untyped_storage()
        n = s.nbytes()
        base = ctypes.c_uint64()
        ok(cu.cuMemAlloc_v2(ctypes.byref(base), ctypes.c_size_t(n + 4096)), "cuMemAlloc_v2")
        allocs.append(base)
        p = base.value + 4096  # not at the allocation's start
        zeros = (ctypes.c_ubyte * n)()
        ok(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p), zeros, ctypes.c_size_t(n)), "zeros")
        ok(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(p), ctypes.c_void_p(s.data_ptr()), ctypes.c_size_t(n), stream), "late")
        mirror[s.data_ptr()] = p
        return p

    def sidecar_imports():
        # The fake's count of device memory the sidecar has imported and not
        # closed (its counters file; this process's own is left out).
        d = os.environ["FAKE_CUDA_STATS_DIR"]
        n = 0
        for name in os.listdir(d):
            if name.isdigit() and name != str(os.getpid()):
                for line in open(os.path.join(d, name)):
                    k, v = line.split()
                    n += int(v) if k == "imports_open" else 0
        return n

    CHUNK = 2 << 20  # the fake's VMM granularity
    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]
    class Prop(ctypes.Structure):  # CUmemAllocationProp
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                    ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]
    class Access(ctypes.Structure):  # CUmemAccessDesc
        _fields_ = [("location", Location), ("flags", ctypes.c_int)]

    def vmm_chunks(n):
        # n VMM chunks (each its own cuMemCreate, exportable as a POSIX fd)
        # mapped back to back into one reserved range, as PyTorch's
        # expandable segments map them; the range's base.
        base = ctypes.c_uint64()
        ok(cu.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(n * CHUNK), ctypes.c_size_t(0),
                                  ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        prop = Prop(type=1, requestedHandleTypes=1, location=Location(1, 0))
        for k in range(n):
            h = ctypes.c_uint64()
            ok(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(CHUNK), ctypes.byref(prop), ctypes.c_ulonglong(0)), "cuMemCreate")
            at = ctypes.c_uint64(base.value + k * CHUNK)
            ok(cu.cuMemMap(at, ctypes.c_size_t(CHUNK), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")
            access = Access(location=Location(1, 0), flags=3)
            ok(cu.cuMemSetAccess(at, ctypes.c_size_t(CHUNK), ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
            ok(cu.cuMemRelease(h), "cuMemRelease")
        return base.value

    def place(t, p):
        # t's storage mirrored at device address p (zeros, then a late copy).
        s = t.untyped_storage()
        n = s.nbytes()
        zeros = (ctypes.c_ubyte * n)()
        ok(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p), zeros, ctypes.c_size_t(n)), "zeros")
        ok(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(p), ctypes.c_void_p(s.data_ptr()), ctypes.c_size_t(n), stream), "late")
        mirror[s.data_ptr()] = p

    def device_storage(storage, torch):
        p = mirror.get(storage.data_ptr())
        return None if p is None else (p, storage.nbytes(), 0, stream.value)
    _hook._device_storage = device_storage
    _hook._host_tensor = lambda t: t.untyped_storage().data_ptr() not in mirror  # the pre-scan's view of it
    _hook._cuda_possible = lambda torch: True
    _hook.install()

    def original(obj):
        b = io.BytesIO()
        torch.save.__wrapped__(obj, b)
        return b.getvalue()

    def equal(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return a == b

    torch.save({"warm": 1}, os.path.join(out, "warm.pt"))  # starts the sidecar (written here)
    assert _hook.wait_sidecar(120) or os.environ.get("CKPT_SIDECAR_HOOK_CUDA"), "no sidecar"
    report = {}

    a = torch.arange(100000, dtype=torch.float32) * 0.25 - 3
    state = {
        "model": {"a": a, "a_view": a[10:20], "b": torch.ones(3, 5, dtype=torch.bfloat16) * 7,
                  "i": torch.arange(64 * 64, dtype=torch.int64).reshape(64, 64) * 3 - 5,
                  "empty": torch.zeros(0)},
        "host": torch.linspace(0, 1, 333, dtype=torch.float64),  # a CPU storage among device ones
        "step": 7, "name": "run",
    }
    expected = original(state)
    for t in (state["model"]["a"], state["model"]["b"], state["model"]["i"]):
        on_device(t)

    if mode == "device":
        path = os.path.join(out, "model.pt")
        torch.save(state, path)  # returns once the sidecar placed the file and made it durable
        report["identical_at_return"] = open(path, "rb").read() == expected
        # Device bytes changed after torch.save returned never reach the file.
        junk = (ctypes.c_ubyte * 4096)(*([0xee] * 4096))
        for p in mirror.values():
            ok(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p), junk, ctypes.c_size_t(512)), "junk")
        assert _hook.flush(120)
        got = open(path, "rb").read()
        report["identical"] = got == expected
        report["sizes"] = [len(got), len(expected)]
        if got != expected:
            diff = [i for i in range(min(len(got), len(expected))) if got[i] != expected[i]]
            report["first_diffs"] = diff[:8]
        report["loads_equal"] = equal(torch.load(path, weights_only=True), state)
        # Many files in a row, the same path each time: the last one wins.
        for t in (state["model"]["a"], state["model"]["b"], state["model"]["i"]):
            on_device(t)  # afresh: the junk above is in the old copies
        for k in range(3):
            state["step"] = k
            torch.save(state, os.path.join(out, "again.pt"))
        report["again_equal"] = equal(torch.load(os.path.join(out, "again.pt"), weights_only=True), state)
    elif mode == "span":
        # Storages across VMM chunks (PyTorch's expandable segments): one
        # across three chunks, one across two, one inside a chunk of those.
        state = {"across3": torch.arange(5 << 18, dtype=torch.float32) - 7,    # 5 MiB
                 "across2": torch.arange(1 << 19, dtype=torch.int32) * 3,      # 2 MiB
                 "inside": torch.ones(1000, dtype=torch.float64) * 0.5,
                 "host": torch.linspace(0, 1, 333, dtype=torch.float64), "step": 3}
        expected = original(state)
        mirror.clear()  # only these storages are on the device
        b3, b2 = vmm_chunks(3), vmm_chunks(2)
        place(state["across3"], b3 + (1 << 20))             # chunks 0-2 of the first range
        place(state["across2"], b2 + (1 << 20) + 4096)      # chunks 0-1 of the second
        place(state["inside"], b2 + 4096)                   # inside chunk 0 of the second
        path = os.path.join(out, "span.pt")
        torch.save(state, path)
        junk = (ctypes.c_ubyte * 8192)(*([0xee] * 8192))
        for p in (b3 + (2 << 20) - 4096, b2 + (2 << 20) - 4096, b2 + 4096):  # across chunk boundaries too
            ok(cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p), junk, ctypes.c_size_t(8192)), "junk")
        assert _hook.flush(120)
        report["identical"] = open(path, "rb").read() == expected
        report["loads_equal"] = equal(torch.load(path, weights_only=True), state)
    elif mode == "cpu":
        # CUDA is initialised (_cuda_possible): a CPU-only object goes the
        # host way with no skip_data pass (counted here), however nested; a
        # device storage anywhere in it, or behind an object the pre-scan does
        # not know, still goes the CUDA way.
        passes = [0]
        real_skip_data = torch.serialization.skip_data
        def counting_skip_data(*a, **k):
            passes[0] += 1
            return real_skip_data(*a, **k)
        torch.serialization.skip_data = counting_skip_data
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        cpu_state = {
            "model": model.state_dict(),  # an OrderedDict with _metadata
            "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}},
                    "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
            "rng": (torch.get_rng_state(), np.random.get_state(), random.getstate()),
            "tags": {"a", "b"}, "shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "epoch": np.int64(2),
        }
        ways = []
        def save(name, obj):
            before, device = passes[0], _hook.cuda_counts()["device"]
            path = os.path.join(out, name)
            want = original(obj)
            torch.save(obj, path)
            assert _hook.flush(120)
            ways.append({"name": name, "skip_data_passes": passes[0] - before,
                         "device": _hook.cuda_counts()["device"] - device,
                         "identical": open(path, "rb").read() == want})
        save("cpu.pt", cpu_state)
        dev = state["model"]["b"]  # mirrored on the device
        save("deep.pt", {"outer": [({"inner": collections.OrderedDict(w=dev)},)], "cpu": cpu_state})
        od = collections.OrderedDict(x=torch.zeros(2))
        od._meta = {"w": dev}  # an attribute of the container, pickled with it
        save("attr.pt", od)
        save("unknown.pt", {"ns": types.SimpleNamespace(w=dev), "cpu": cpu_state})
        t = torch.zeros(3)
        t.extra = dev  # a tensor's attributes are pickled with it
        save("tensor-attr.pt", {"t": t})
        report["ways"] = ways
    elif mode == "freed":
        # The allocation a saved storage lay in is freed; the storage now lies
        # in another one (at another address: allocated before the free). At
        # the next save, registering the new allocation unregisters the old
        # one, whose memory is gone: the sidecar closes its import.
        mirror.clear()
        x = {"x": state["model"]["i"]}
        on_device(x["x"])
        torch.save(x, os.path.join(out, "freed1.pt"))
        assert _hook.flush(120)
        first = sidecar_imports()
        old = allocs.pop()
        on_device(x["x"])
        ok(cu.cuMemFree_v2(old), "cuMemFree")
        path = os.path.join(out, "freed2.pt")
        torch.save(x, path)
        assert _hook.flush(120)
        deadline = time.monotonic() + 60  # the sidecar closes it as it answers; polled, generously
        while sidecar_imports() != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        report["imports_open"] = [first, sidecar_imports()]
        report["identical"] = open(path, "rb").read() == original(x)
    elif mode == "refused":
        # Larger than the sidecar's whole staging: refused before Released,
        # so the original torch.save runs (host way) and the file is written.
        big = torch.arange(24 << 20, dtype=torch.int32)
        state["big"] = big
        expected = original(state)
        on_device(big)
        path = os.path.join(out, "big.pt")
        torch.save(state, path)
        assert _hook.flush(120)
        report["identical"] = open(path, "rb").read() == expected
        report["loads_equal"] = equal(torch.load(path, weights_only=True), state)
    elif mode == "host":
        path = os.path.join(out, "model.pt")
        torch.save(state, path)
        assert _hook.flush(120)
        report["identical"] = open(path, "rb").read() == expected
        report["loads_equal"] = equal(torch.load(path, weights_only=True), state)
    report["cuda"] = _hook.cuda_counts()
    report["counts"] = _hook.counts()
    ok(cu.cuStreamSynchronize(stream), "sync")
    for b in allocs:
        ok(cu.cuMemFree_v2(b), "cuMemFree")
    print(json.dumps(report))
""")


def run(tmp_path, mode, private_tmp, **env_extra):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR") or k in ("CKPT_SIDECAR_LIB", "CKPT_SIDECAR_BIN")}
    env["CKPT_SIDECAR_SOCKET"] = str(tmp_path / "no-sidecar.sock")  # the hook spawns its own
    env["CKPT_SIDECAR_STAGING"] = "64MiB"
    env["TMPDIR"] = private_tmp
    env["LD_LIBRARY_PATH"] = str(fake_dir())
    env["FAKE_CUDA_COPY_DELAY_US"] = "200000"  # this trainer's copies finish late
    import ckpt_sidecar
    pkg_parent = str(pathlib.Path(ckpt_sidecar.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(env_extra)
    proc = subprocess.Popen([sys.executable, str(script), mode, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
        for pattern in (f"fakecuda-{proc.pid}-*", f"fakecuda-ev-{proc.pid}-*"):
            for f in pathlib.Path("/dev/shm").glob(pattern):
                f.unlink(missing_ok=True)
    assert proc.returncode == 0, stderr
    import json
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def test_cuda_storages_go_from_the_device_and_the_file_is_torch_saves_own(tmp_path, private_tmp):
    r, err = run(tmp_path, "device", private_tmp)
    assert r["cuda"] == {"device": 4, "fell_back": 0}, (r, err)
    assert r["identical"] and r["identical_at_return"], (r, err)
    assert r["loads_equal"] and r["again_equal"], r
    assert r["counts"]["in_process"] == 1, r  # only the first file, before the sidecar answered


def test_storages_across_vmm_chunks_go_from_the_device(tmp_path, private_tmp):
    """A storage across two or three VMM chunks mapped back to back (PyTorch's
    expandable segments) is registered as one span and copied from the
    device, not sent the host way; the file is torch.save's own."""
    r, err = run(tmp_path, "span", private_tmp)
    assert r["cuda"] == {"device": 1, "fell_back": 0}, (r, err)
    assert "host way" not in err and "did not take" not in err, err
    assert r["identical"] and r["loads_equal"], (r, err)


def test_a_cpu_only_save_after_cuda_init_runs_no_skip_data_pass(tmp_path, private_tmp):
    """Once CUDA is initialised, a CPU-only object (a state dict, optimizer
    state, RNG states, nested) goes the host way without the skip_data pass;
    a device storage nested deep, in a container's attributes, in a tensor's
    attributes, or behind an object the pre-scan does not know, goes the
    CUDA way. Every file is torch.save's own bytes."""
    r, err = run(tmp_path, "cpu", private_tmp)
    ways = {w.pop("name"): w for w in r["ways"]}
    assert ways == {
        "cpu.pt": {"skip_data_passes": 0, "device": 0, "identical": True},
        "deep.pt": {"skip_data_passes": 1, "device": 1, "identical": True},
        "attr.pt": {"skip_data_passes": 1, "device": 1, "identical": True},
        "unknown.pt": {"skip_data_passes": 1, "device": 1, "identical": True},
        "tensor-attr.pt": {"skip_data_passes": 1, "device": 1, "identical": True},
    }, (ways, err)
    assert r["cuda"] == {"device": 4, "fell_back": 0}, (r, err)


def test_the_import_of_a_freed_allocation_is_closed_at_the_next_registration(tmp_path, private_tmp):
    """A storage saved from one allocation, that allocation freed, the storage
    saved again from another: after each save the sidecar holds no import
    at all (a legacy import closes with the request that opened it: the
    trainer may free the memory at any time), the stale one included."""
    stats = tmp_path / "stats"
    stats.mkdir()
    r, err = run(tmp_path, "freed", private_tmp, FAKE_CUDA_STATS_DIR=str(stats))
    assert r["imports_open"] == [0, 0], (r, err)
    assert r["identical"] and r["cuda"] == {"device": 2, "fell_back": 0}, (r, err)


def test_a_refusal_before_released_falls_back_to_the_original_torch_save(tmp_path, private_tmp):
    r, err = run(tmp_path, "refused", private_tmp)
    assert r["cuda"] == {"device": 0, "fell_back": 1}, (r, err)
    assert "did not write torch.save" in err and "from the device" in err, err
    assert r["identical"] and r["loads_equal"], r


def test_the_host_opt_out_keeps_the_host_way(tmp_path, private_tmp):
    r, err = run(tmp_path, "host", private_tmp, CKPT_SIDECAR_HOOK_CUDA="host")
    assert r["cuda"] == {"device": 0, "fell_back": 0}, (r, err)
    assert r["identical"] and r["loads_equal"], r
    assert r["counts"] == {"sidecar": 0, "in_process": 2, "superseded": 0}, r  # no sidecar started
    # An unknown value: one line, and the way that loses nothing.
    r, err = run(tmp_path, "host", private_tmp, CKPT_SIDECAR_HOOK_CUDA="gpu")
    assert r["cuda"]["device"] == 0 and r["identical"], r
    assert 'CKPT_SIDECAR_HOOK_CUDA="gpu": expected one of device, host' in err, err


def test_a_file_of_host_pieces_and_a_refused_archive(ck, tmp_path):
    """SaveFilePieces with host pieces only (no event): laid end to end; a
    torch.save archive is finished into itself; pieces that are no torch.save
    archive are refused before Released, and no file appears."""
    import ctypes
    import io

    from ckpt_sidecar.errors import BadRequest

    with ck._mu:
        r = ck._alloc(1 << 20)
    ctypes.memmove(r.ptr, b"hello ", 6)
    ctypes.memmove(r.ptr + 4096, b"world", 5)
    path = tmp_path / "plain.txt"
    h = ck.save_file_pieces(path, [(r.ptr, 6, False), (r.ptr + 4096, 5, False), (r.ptr, 0, False)], None, False)
    h.wait_durable(timeout=60)
    assert path.read_bytes() == b"hello world"

    b = io.BytesIO()
    torch.save({"x": torch.arange(10.0)}, b)
    data = b.getvalue()
    ctypes.memmove(r.ptr, data, len(data))
    path = tmp_path / "whole.pt"
    ck.save_file_pieces(path, [(r.ptr, 100, False), (r.ptr + 100, len(data) - 100, False)], None, True).wait_durable(timeout=60)
    assert path.read_bytes() == data

    path = tmp_path / "not-an-archive.pt"
    h = ck.save_file_pieces(path, [(r.ptr + 4096, 5, False)], None, True)
    with pytest.raises(BadRequest, match="not a torch.save zip archive"):
        h.wait_taken(timeout=60)
    assert not path.exists()


def test_a_device_file_the_sidecar_fails_after_released_falls_back_to_the_host_way(tmp_path):
    """The CUDA way waits inside torch.save until the sidecar reports the
    file durable: when it fails after Released (here a handle that reports
    the sidecar gone), send_pieces says so and returns False, so that
    torch.save, still running, takes the host way; nothing is left to fail
    after the return."""
    from ckpt_sidecar import _file_queue
    from ckpt_sidecar.errors import Disconnected

    class Gone:
        def wait_taken(self):
            pass

        def wait_durable(self):
            raise Disconnected("the sidecar closed the connection", Disconnected.code)

    class Sidecar:
        def save_file_pieces(self, path, pieces, stream, torch_zip):
            return Gone()

    files = _file_queue._Files()
    assert files.send_pieces(Sidecar(), str(tmp_path / "a.pt"), [], None, True) is False
    assert files.cuda == {"device": 0, "fell_back": 1}
    assert files.counts["sidecar"] == 0 and not files.untold()
