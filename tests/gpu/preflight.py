"""The GPU run's preflight (tests/gpu/run.sh runs it first, at most 60 s):
what this machine's driver really does of what the CUDA path needs, in two
processes, before any check relies on it. A sandbox's GPU proxy (gVisor)
passes through only the driver calls it implements, so each probe is
bounded and its failure is a finding, not a crash:

- driver: libcuda.so.1, cuInit, the devices (UUID, name), the version;
- ipc_mem: a cuMemAlloc allocation's legacy IPC handle opened in a second
  process (cuIpcOpenMemHandle, open and close timed), its bytes read there;
- ipc_event: an interprocess event's handle opened in the second process
  (cuIpcOpenEventHandle, timed) and queried;
- vmm_fd: a VMM allocation (cuMemCreate, POSIX fd handle type) exported as a
  file descriptor, passed over a socket, imported and mapped in the second
  process, its bytes read there;
- stream_wait: host memory registered (cuMemHostRegister DEVICEMAP |
  PORTABLE), a stream made to wait on a word of it (cuStreamWaitValue32),
  still waiting, then released by a host write;
- register_1gib: one 1 GiB host registration, timed (and its unregistration).

Writes the findings to $OUT/gpu-preflight.json (rewritten after each probe)
when OUT is set, and prints them. Each probe is "passed", "FAILED: why" or
"skipped: why"; `skip_all` says why nothing can run (no driver, the fake).
Needs only Python 3 (ctypes): no torch. Exit status 0 always: the suite
reads the findings and skips what the machine cannot do.
"""

import ctypes
import json
import os
import socket
import subprocess
import sys
import time

DEADLINE_S = 55.0  # the whole preflight, run.sh's timeout (60 s) included
T0 = time.monotonic()
report = {"seconds": 0.0, "skip_all": None, "driver": {}, "probes": {}, "figures": {}}


def write():
    report["seconds"] = round(time.monotonic() - T0, 3)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, ".gpu-preflight.json.tmp")
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, os.path.join(out, "gpu-preflight.json"))


def left_s():
    return max(0.5, DEADLINE_S - (time.monotonic() - T0))


def load_driver():
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"no CUDA driver (libcuda.so.1: {e})"
    if cu.cuInit(0) != 0:
        return None, "no CUDA driver usable (cuInit failed)"
    return cu, None


class Handle(ctypes.Structure):
    """CUipcMemHandle / CUipcEventHandle: 64 bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]

    @staticmethod
    def of(hex_text):
        return Handle.from_buffer_copy(bytes.fromhex(hex_text))


def ok(r, what):
    if r != 0:
        raise RuntimeError(f"{what} = {r}")


class Ms:
    """Times a block in ms into report['figures'][name]."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *a):
        report["figures"][self.name] = round((time.perf_counter() - self.t0) * 1e3, 3)


def context(cu):
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev


# ---- the second process: opens what the first exported ----

def child(sock_fd):
    cu, why = load_driver()
    sock = socket.socket(fileno=sock_fd)
    if cu is None:
        sock.sendall(json.dumps({"error": why}).encode() + b"\n")
        return
    context(cu)
    f = sock.makefile("rb")
    while True:
        line = f.readline()
        if not line:
            return
        req = json.loads(line)
        got = {}
        try:
            if req["op"] == "ipc_mem":
                h = Handle.of(req["handle"])
                ptr = ctypes.c_uint64()
                t0 = time.perf_counter()
                ok(cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, ctypes.c_uint(1)), "cuIpcOpenMemHandle_v2")
                got["open_ms"] = (time.perf_counter() - t0) * 1e3
                buf = (ctypes.c_ubyte * req["n"])()
                ok(cu.cuMemcpyDtoH_v2(buf, ptr, ctypes.c_size_t(req["n"])), "cuMemcpyDtoH_v2")
                got["bytes_ok"] = bytes(buf) == bytes(range(256)) * (req["n"] // 256)
                t0 = time.perf_counter()
                ok(cu.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
                got["close_ms"] = (time.perf_counter() - t0) * 1e3
            elif req["op"] == "ipc_event":
                h = Handle.of(req["handle"])
                ev = ctypes.c_void_p()
                t0 = time.perf_counter()
                ok(cu.cuIpcOpenEventHandle(ctypes.byref(ev), h), "cuIpcOpenEventHandle")
                got["open_ms"] = (time.perf_counter() - t0) * 1e3
                got["query"] = cu.cuEventQuery(ev)
                ok(cu.cuEventDestroy_v2(ev), "cuEventDestroy_v2")
            elif req["op"] == "vmm_fd":
                msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
                fd = fds[0]
                handle = ctypes.c_ulonglong()
                ok(cu.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), 1),
                   "cuMemImportFromShareableHandle")
                os.close(fd)
                size = req["size"]
                ptr = ctypes.c_uint64()
                ok(cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                          ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
                ok(cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)),
                   "cuMemMap")
                desc = (ctypes.c_int * 3)(1, req["device"], 3)  # location DEVICE, id, PROT_READWRITE
                ok(cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), desc, ctypes.c_size_t(1)), "cuMemSetAccess")
                buf = (ctypes.c_ubyte * 4096)()
                ok(cu.cuMemcpyDtoH_v2(buf, ptr, ctypes.c_size_t(4096)), "cuMemcpyDtoH_v2")
                got["bytes_ok"] = bytes(buf) == bytes(range(256)) * 16
                cu.cuMemUnmap(ptr, ctypes.c_size_t(size))
                cu.cuMemAddressFree(ptr, ctypes.c_size_t(size))
                cu.cuMemRelease(handle)
        except Exception as e:  # a finding for the first process
            got["error"] = str(e)
        sock.sendall(json.dumps(got).encode() + b"\n")


# ---- the first process ----

class Peer:
    """The second process, asked one probe at a time, each bounded."""

    def __init__(self):
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self.f = self.sock.makefile("rb")

    def ask(self, req, fd=None):
        self.sock.settimeout(min(15.0, left_s()))
        data = json.dumps(req).encode() + b"\n"
        self.sock.sendall(data)
        if fd is not None:
            socket.send_fds(self.sock, [b"f"], [fd])
        line = self.f.readline()
        if not line:
            raise RuntimeError("the second process ended without answering")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(got["error"])
        return got

    def close(self):
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def probe(name, fn):
    if time.monotonic() - T0 > DEADLINE_S:
        report["probes"][name] = "skipped: the preflight's 55 s were spent"
    else:
        try:
            fn()
            report["probes"][name] = "passed"
        except socket.timeout:
            report["probes"][name] = "FAILED: no answer in time (the driver call hangs here)"
        except Exception as e:
            report["probes"][name] = f"FAILED: {e}"
    write()


def main():
    write()
    cu, why = load_driver()
    if cu is None:
        report["skip_all"] = why
        write()
        return
    n, ver = ctypes.c_int(), ctypes.c_int()
    cu.cuDeviceGetCount(ctypes.byref(n))
    cu.cuDriverGetVersion(ctypes.byref(ver))
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGetName(name, 256, 0)
    uuid = (ctypes.c_ubyte * 16)()
    cu.cuDeviceGetUuid_v2(uuid, 0)
    report["driver"] = {"version": ver.value, "devices": n.value, "name": name.value.decode(errors="replace"),
                        "uuid": bytes(uuid).hex()}
    if n.value == 0:
        report["skip_all"] = "the driver sees no CUDA device"
    elif b"fake" in name.value and not os.environ.get("CKPT_GPU_PREFLIGHT_ON_FAKE"):
        report["skip_all"] = "no CUDA driver (only the test-only fake one)"
    if report["skip_all"]:
        write()
        return
    dev = context(cu)
    peer = Peer()
    try:
        run_probes(cu, dev.value, peer)
    finally:
        peer.close()
    write()


def run_probes(cu, dev, peer):
    n = 1 << 20
    src = (ctypes.c_ubyte * n).from_buffer_copy(bytes(range(256)) * (n // 256))

    def ipc_mem():
        d = ctypes.c_uint64()
        ok(cu.cuMemAlloc_v2(ctypes.byref(d), ctypes.c_size_t(n)), "cuMemAlloc_v2")
        ok(cu.cuMemcpyHtoD_v2(d, src, ctypes.c_size_t(n)), "cuMemcpyHtoD_v2")
        h = Handle()
        ok(cu.cuIpcGetMemHandle(ctypes.byref(h), d), "cuIpcGetMemHandle")
        got = peer.ask({"op": "ipc_mem", "handle": bytes(h).hex(), "n": n})
        report["figures"]["ipc_mem_open_ms"], report["figures"]["ipc_mem_close_ms"] = got["open_ms"], got["close_ms"]
        cu.cuMemFree_v2(d)
        assert got["bytes_ok"], "the second process read other bytes"

    def ipc_event():
        ev = ctypes.c_void_p()
        ok(cu.cuEventCreate(ctypes.byref(ev), ctypes.c_uint(0x4 | 0x2)), "cuEventCreate(INTERPROCESS)")
        h = Handle()
        ok(cu.cuIpcGetEventHandle(ctypes.byref(h), ev), "cuIpcGetEventHandle")
        got = peer.ask({"op": "ipc_event", "handle": bytes(h).hex()})
        report["figures"]["ipc_event_open_ms"] = got["open_ms"]
        cu.cuEventDestroy_v2(ev)
        assert got["query"] == 0, f"cuEventQuery of a never-recorded event = {got['query']}"

    def vmm_fd():
        # CUmemAllocationProp: type PINNED (1), requestedHandleTypes POSIX_FD (1), location DEVICE (1) dev.
        prop = (ctypes.c_int * 8)(1, 1, 1, dev, 0, 0, 0, 0)
        gran = ctypes.c_size_t()
        ok(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), prop, 0), "cuMemGetAllocationGranularity")
        size = gran.value
        h = ctypes.c_ulonglong()
        ok(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), prop, ctypes.c_ulonglong(0)), "cuMemCreate")
        ptr = ctypes.c_uint64()
        ok(cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                  ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        ok(cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")
        desc = (ctypes.c_int * 3)(1, dev, 3)
        ok(cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), desc, ctypes.c_size_t(1)), "cuMemSetAccess")
        ok(cu.cuMemcpyHtoD_v2(ptr, src, ctypes.c_size_t(4096)), "cuMemcpyHtoD_v2")
        fd = ctypes.c_int(-1)
        ok(cu.cuMemExportToShareableHandle(ctypes.byref(fd), h, 1, ctypes.c_ulonglong(0)),
           "cuMemExportToShareableHandle(POSIX_FD)")
        try:
            got = peer.ask({"op": "vmm_fd", "size": size, "device": dev}, fd=fd.value)
        finally:
            os.close(fd.value)
            cu.cuMemUnmap(ptr, ctypes.c_size_t(size))
            cu.cuMemAddressFree(ptr, ctypes.c_size_t(size))
            cu.cuMemRelease(h)
        assert got["bytes_ok"], "the second process read other bytes"

    def stream_wait():
        import mmap
        page = mmap.mmap(-1, 4096)
        word = ctypes.c_uint32.from_buffer(page)
        addr = ctypes.addressof(word)
        ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(4096), ctypes.c_uint(0x1 | 0x2)),
           "cuMemHostRegister(DEVICEMAP|PORTABLE)")
        try:
            dptr = ctypes.c_uint64()
            ok(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(addr), ctypes.c_uint(0)),
               "cuMemHostGetDevicePointer")
            s = ctypes.c_void_p()
            ok(cu.cuStreamCreate(ctypes.byref(s), ctypes.c_uint(1)), "cuStreamCreate")
            ok(cu.cuStreamWaitValue32_v2(s, dptr, ctypes.c_uint32(1), ctypes.c_uint(0)), "cuStreamWaitValue32")
            time.sleep(0.05)
            waiting = cu.cuStreamQuery(s)
            assert waiting == 600, f"the stream did not wait for the word (cuStreamQuery = {waiting})"
            word.value = 1
            t0 = time.monotonic()
            while cu.cuStreamQuery(s) != 0:
                assert time.monotonic() - t0 < min(5.0, left_s()), "the host write did not release the stream in 5 s"
                time.sleep(0.001)
            report["figures"]["stream_wait_release_ms"] = (time.monotonic() - t0) * 1e3
        finally:
            del word
            cu.cuMemHostUnregister(ctypes.c_void_p(addr))

    def register_1gib():
        import mmap
        size = 1 << 30
        m = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        try:
            with Ms("register_1gib_ms"):
                ok(cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(size), ctypes.c_uint(0x1)),
                   "cuMemHostRegister(1 GiB)")
            with Ms("unregister_1gib_ms"):
                ok(cu.cuMemHostUnregister(ctypes.c_void_p(addr)), "cuMemHostUnregister")
        finally:
            pass

    probe("ipc_mem", ipc_mem)
    probe("ipc_event", ipc_event)
    probe("vmm_fd", vmm_fd)
    probe("stream_wait", stream_wait)
    probe("register_1gib", register_1gib)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(int(sys.argv[2]))
    else:
        main()
        print(json.dumps(report, indent=1), flush=True)
