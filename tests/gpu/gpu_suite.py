"""The CUDA path on a real GPU: checks and benchmark (run by tests/gpu/run.sh,
which builds first and sets CKPT_SIDECAR_BIN / CKPT_SIDECAR_LIB / PYTHONPATH).

Checks (each "passed" or "FAILED: why"; the exit status is 1 if any failed):
- checkpointer_roundtrip: torch CUDA tensors (two views into one storage, one
  at an offset; bf16; a Parameter) saved from the device by Checkpointer (no
  host copy in the trainer), changed on the GPU right after Released, loaded
  back bit-exact to the CPU and to the GPU, and restored in place into device
  memory by the sidecar (load_into); a second save of the state reuses the
  kept save plan;
- hook_roundtrip: torch.save / torch.load of CUDA tensors through the hook,
  the CUDA way (the sidecar copies the storages from the device; changed on
  the GPU right after torch.save returned): the file is byte-identical to the
  original torch.save's and loads back equal, to the CPU and to the GPU;
- sigkill_after_released_commits: a trainer SIGKILLed right after Released;
  the sidecar still commits and the checkpoint verifies;
- restore_to_gpu_c: the C trainer (tests/c/cuda_trainer.c, linked with the
  real libcuda.so.1) saves device memory behind its stream's event and
  restores into device memory, bit-exact;
- vmm_c: the same C trainer with VMM allocations (cuMemCreate exportable as
  a POSIX fd, passed over the socket): round trip in place, and a trainer
  SIGKILLed right after Released whose step commits and is loaded back
  bit-exact by another process; an allocation without the fd handle type is
  refused naming it;
- guard_stream_wait_c / guard_stream_wait_torch: the next step's write,
  queued right after ckpt_stream_wait_copy (C) or optimizer.step() under
  guard(optimizer) (torch), stays out of the snapshot;
- span_and_realloc_c: the C trainer's "span" mode (tensors crossing two and
  three VMM chunks mapped back to back in one reserved range, round trip in
  place; a range into an unmapped chunk refused) and "realloc" mode (memory
  freed and allocated again at the same address is saved with its new
  bytes; inconclusive, and said so, if the driver did not reuse the address);
- expandable_segments_torch: torch with
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, tensors that cross the
  allocator's chunks, saved and loaded back bit-exact; then freed,
  empty_cache(), allocated again (same shapes: the kept save plan) with
  other values and saved again: the second step holds the new values.
  Whether the tensors went in place (no host copy) is reported;
- hook_expandable_segments: the same allocator setting, CUDA tensors that
  cross its chunks saved through the torch.save hook the CUDA way (its
  storages registered as spans), twice with empty_cache() between: each
  file byte-identical to the original torch.save's, none fell back to the
  host way; then a CPU-only state saved with CUDA initialised runs no
  skip_data pass;
- sidecar_killed_trainer_steps_on: copies queued
  behind a long kernel (torch.cuda._sleep before save: the sidecar's copy
  cannot have run), the optimizer step under guard(optimizer) queued, the
  sidecar SIGKILLed: the trainer's next step completes within 5 s of the
  kill (plus what is left of the kernel);
- trainer_killed_before_event (hazard 1): a trainer SIGKILLed while its save
  waits behind a long kernel: the sidecar's session ends within 10 s and
  its staging is free (status);
- empty_cache_frees_for_the_trainer (hazard 2): with the default (legacy
  IPC) allocator, a tensor of 60 % of the free memory saved, deleted,
  empty_cache(), then 60 % allocated again: it fits only if the sidecar
  closed its import;
- two_ranks_visible_devices (hazard 3): two ranks with different
  CUDA_VISIBLE_DEVICES orders save their cuda:0 tensors as parts of one
  step, loaded back bit-exact (skipped, saying so, with one GPU);
- dcp_cuda: dcp.save and dcp.async_save (no_dist) of 1 GiB of
  CUDA tensors through SidecarWriter: no trainer-side host copy (the parts'
  copied_bytes are 0), the trainer's stall inside async_save (warm: a
  first async_save makes the sidecar's context) under half the time a
  `.cpu()` copy of the same tensors takes (what torch's DefaultStager did),
  the tensors changed on the GPU right after async_save returned, and both
  steps loaded back by dcp.load equal to the state as saved;
- figures_issue_9: the benchmark's figures asserted: D2H ≥ 0.8 × pinned
  cudaMemcpy, the trainer's CPU in save() < 1 ms for 4 GiB, a step while
  the sidecar copies ≤ 5 % slower.

Benchmark (figures, compared in the same run): a 4 GiB state of CUDA
tensors; device-to-host snapshot bandwidth (bytes / the sidecar's copy
seconds) beside a plain pinned cudaMemcpy of the same size; the trainer's
CPU time inside save(); a training step's time while the sidecar copies,
against the same step alone.

Each check is "passed", "FAILED: why" or "skipped: why" (a skip never
counts as passing); the report ($OUT/gpu-results.json) is rewritten after
every check, so a run cut short still leaves what it did.

The preflight's findings ($CKPT_GPU_PREFLIGHT, tests/gpu/preflight.py) decide
what runs: a check needing what the machine lacks (legacy IPC, VMM fd
export) is skipped naming the failed probe. torch.cuda._sleep takes cycles,
not seconds, and the SM clock moves (345 MHz idle, 1980 MHz busy were seen
on one machine), so its rate is measured first (`sleep_cycles_per_s`).
Every threshold is reported with its figure (`thresholds`: figure, limit,
passed), whether it passes or not; the legacy IPC imports' open and close
times of every sidecar, per request, are in `ipc_import_times`.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

import torch

import ckpt_sidecar as cs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ["CKPT_SIDECAR_BIN"]
LIB = os.environ["CKPT_SIDECAR_LIB"]
GIB = 1 << 30
results = {"device": torch.cuda.get_device_name(0), "checks": {}, "bench": {}, "thresholds": {},
           "ipc_import_times": []}


def preflight():
    """The preflight's findings (tests/gpu/preflight.py), {} when it left none."""
    try:
        with open(os.environ.get("CKPT_GPU_PREFLIGHT", "")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


PREFLIGHT = preflight()
results["preflight"] = PREFLIGHT.get("probes", {})


def needs(*probes):
    """Skips the check (saying which) unless the preflight found each probe passing."""
    for p in probes:
        got = PREFLIGHT.get("probes", {}).get(p)
        if got is not None and got != "passed":
            raise Skip(f"the preflight's {p} probe: {got}")


def threshold(name, figure, limit, at_most=True, unit=""):
    """Records a threshold with its figure (passed or not); True if it passed."""
    passed = figure is not None and (figure <= limit if at_most else figure >= limit)
    results["thresholds"][name] = {"figure": figure, "limit": limit, "at_most": at_most, "unit": unit,
                                   "passed": passed}
    print(f"threshold {name}: {figure} {unit} ({'<=' if at_most else '>='} {limit}): "
          f"{'passed' if passed else 'FAILED'}", flush=True)
    write_report()
    return passed


def sleep_cycles_per_s():
    """torch.cuda._sleep's cycles per second on this GPU now: the clock is
    raised by a busy warm-up first, then one ~0.5 s sleep is timed."""
    if "sleep_cycles_per_s" in results["bench"]:
        return results["bench"]["sleep_cycles_per_s"]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # warm-up: the SM clock rises when busy
    torch.cuda.synchronize()
    rate = 1e9
    for _ in range(2):
        cycles = int(0.5 * rate)
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        rate = cycles / (time.perf_counter() - t0)
    results["bench"]["sleep_cycles_per_s"] = rate
    return rate


def sleep_cycles(seconds):
    """Cycles for torch.cuda._sleep to keep this GPU busy about `seconds`."""
    return int(seconds * sleep_cycles_per_s())


class Serve:
    """A `ckpt-sidecar serve` on a private socket."""

    def __init__(self, tmp, staging="1GiB"):
        self.dir, self.socket, self.log = os.path.join(tmp, "ck"), os.path.join(tmp, "s.sock"), os.path.join(tmp, "serve.log")
        env = dict(os.environ, CKPT_SIDECAR_LOG=os.environ.get("CKPT_SIDECAR_LOG", "info"))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([BIN, "serve", "--dir", self.dir, "--socket", self.socket, "--staging", staging],
                                         stdout=log, stderr=log, env=env)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket):
            assert self.proc.poll() is None, open(self.log).read()
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.05)

    def steps(self):
        o = subprocess.run([BIN, "ls", self.dir, "--json"], capture_output=True, text=True)
        return [c["step"] for c in json.loads(o.stdout)["checkpoints"]] if o.returncode == 0 else []

    def verify(self):
        o = subprocess.run([BIN, "verify", self.dir], capture_output=True, text=True)
        assert o.returncode == 0, o.stdout + o.stderr

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.record_import_times()

    def record_import_times(self):
        """The per-request open/close times of legacy IPC imports in the log."""
        import re
        try:
            lines = open(self.log, errors="replace").read().splitlines()
        except OSError:
            return
        for line in lines:
            if "legacy CUDA imports of the last request" in line:
                row = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", line)}
                row["check"] = CURRENT[0]
                results["ipc_import_times"].append(row)


class Skip(Exception):
    """A check that cannot run here, and why (never counted as passing)."""


def write_report():
    out = os.environ.get("OUT")
    if out:
        tmp = os.path.join(out, ".gpu-results.json.tmp")
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, os.path.join(out, "gpu-results.json"))


CURRENT = [None]  # the check running, for what its sidecars log


def check(name, fn):
    CURRENT[0] = name
    t0 = time.monotonic()
    try:
        fn()
        results["checks"][name] = "passed"
    except Skip as e:
        results["checks"][name] = f"skipped: {e}"
    except Exception as e:  # every check reports; the exit status says if any failed
        traceback.print_exc()
        results["checks"][name] = f"FAILED: {e!r}"
    results.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 2)
    print(f"{name}: {results['checks'][name]} ({time.monotonic() - t0:.1f} s)", flush=True)
    write_report()


def need_cc():
    import shutil
    if not shutil.which(os.environ.get("CC", "cc")):
        raise Skip("no C compiler (cc) on this machine for the C trainer")


def checkpointer_roundtrip():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        big = torch.randn(1 << 22, device="cuda")
        state = {"model": {"w": torch.randn(2048, 2048, device="cuda"),
                           "h": torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16),
                           "p": torch.nn.Parameter(torch.randn(4096, device="cuda"))},
                 "views": [big[:1000], big[4096:4096 + 2000].view(40, 50)], "step": 3}
        want = {"w": state["model"]["w"].cpu(), "h": state["model"]["h"].cpu(), "p": state["model"]["p"].detach().cpu(),
                "v0": big[:1000].cpu(), "v1": big[4096:6096].view(40, 50).cpu()}
        torch.cuda.synchronize()
        with cs.Checkpointer(dir=os.path.join(tmp, "ck")) as ck:
            h = ck.save(1, state)
            assert h.copied_bytes == 0, f"the trainer copied {h.copied_bytes} bytes to the host"
            h.wait_released(timeout=120)
            # Released: the next step may change the tensors on the GPU at once.
            state["model"]["w"].add_(1.0)
            big.mul_(2.0)
            h.wait_durable(timeout=300)
            for loc in ("cpu", None):
                back = ck.load(1, map_location=loc)
                m = back["model"]
                got = {"w": m["w"], "h": m["h"], "p": m["p"].detach(), "v0": back["views"][0], "v1": back["views"][1]}
                for k, v in want.items():
                    assert got[k].device.type == ("cpu" if loc else "cuda"), (k, got[k].device)
                    assert torch.equal(got[k].cpu(), v), f"{k} differs (map_location={loc})"
                assert isinstance(m["p"], torch.nn.Parameter) and back["step"] == 3
            # Restore straight into device memory (the sidecar's host-to-device copy).
            target = {"model": {"w": torch.zeros(2048, 2048, device="cuda"),
                                "h": torch.zeros(3, 1000, device="cuda", dtype=torch.bfloat16),
                                "p": torch.zeros(4096, device="cuda")},
                      "views": [torch.zeros(1000, device="cuda"), torch.zeros(40, 50, device="cuda")], "step": 0}
            assert ck.load_into(target, 1) == 1
            got = {"w": target["model"]["w"], "h": target["model"]["h"], "p": target["model"]["p"],
                   "v0": target["views"][0], "v1": target["views"][1]}
            for k, v in want.items():
                assert torch.equal(got[k].cpu(), v), f"{k} differs after load_into"
            # A second save of the same state reuses the kept plan (no registration again).
            n_plans = len(ck._save_plans)
            h2 = ck.save(2, state)
            assert h2.copied_bytes == 0 and len(ck._save_plans) == n_plans >= 1, (h2.copied_bytes, n_plans, len(ck._save_plans))
            h2.wait_durable(timeout=300)


def hook_roundtrip():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp)
        try:
            code = textwrap.dedent("""
                import io, sys, torch
                import ckpt_sidecar._hook as hook
                hook.install()
                big = torch.randn(1 << 20, device="cuda")
                sd = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(10, device="cuda"),
                      "h": torch.randn(3, 1000, device="cuda", dtype=torch.bfloat16),
                      "views": [big[:1000], big[4096:6096].view(40, 50)], "cpu": torch.arange(7.0), "step": 3}
                want = io.BytesIO()
                torch.save.__wrapped__(sd, want)  # the original torch.save (archive named "archive", as the hook's)
                want = want.getvalue()
                cpu = {"w": sd["w"].cpu(), "b": sd["b"].cpu(), "h": sd["h"].cpu(), "v0": big[:1000].cpu()}
                torch.save(sd, sys.argv[1])  # the CUDA way: returns once the sidecar copied from the device
                sd["w"].add_(1.0)            # the next step's write, at once
                big.mul_(2.0)
                assert hook.flush(300)
                assert hook.cuda_counts() == {"device": 1, "fell_back": 0, "lost": 0}, hook.cuda_counts()
                got = open(sys.argv[1], "rb").read()
                assert got == want, f"the hook's file differs from torch.save's ({len(got)} vs {len(want)} bytes)"
                back = torch.load(sys.argv[1], map_location="cpu")
                assert torch.equal(back["w"], cpu["w"]) and torch.equal(back["b"], cpu["b"])
                assert torch.equal(back["h"], cpu["h"]) and torch.equal(back["views"][0], cpu["v0"])
                back = torch.load(sys.argv[1])  # onto the GPU
                assert back["w"].is_cuda and torch.equal(back["w"].cpu(), cpu["w"])
                print("ok")
            """)
            env = dict(os.environ, CKPT_SIDECAR="1", CKPT_SIDECAR_SOCKET=serve.socket)
            r = subprocess.run([sys.executable, "-c", code, os.path.join(tmp, "m.pt")], env=env, capture_output=True,
                               text=True, timeout=300)
            assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
        finally:
            serve.stop()


def sigkill_after_released_commits():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp)
        try:
            code = textwrap.dedent("""
                import os, signal, sys, torch
                import ckpt_sidecar as cs
                ck = cs.Checkpointer(socket=sys.argv[1], spawn=False)
                state = {"w": torch.randn(8192, 8192, device="cuda")}
                h = ck.save(5, state)
                assert h.copied_bytes == 0
                h.wait_released(timeout=120)
                print("released", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            """)
            r = subprocess.run([sys.executable, "-c", code, serve.socket], capture_output=True, text=True, timeout=300)
            assert "released" in r.stdout and r.returncode == -signal.SIGKILL, r.stdout + r.stderr
            deadline = time.monotonic() + 120
            while 5 not in serve.steps():
                assert time.monotonic() < deadline, "step 5 never committed: " + open(serve.log).read()[-4000:]
                time.sleep(0.1)
            serve.verify()
        finally:
            serve.stop()


def restore_to_gpu_c():
    needs("ipc_mem", "ipc_event")
    need_cc()
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "cuda_trainer")
        libdir = os.path.dirname(LIB)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-std=c99", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO}/shim-c/include",
                        f"{REPO}/shim-c/tests/c/cuda_trainer.c", "-o", exe, f"-L{libdir}", "-lckpt",
                        f"-Wl,-rpath,{libdir}", "-l:libcuda.so.1"], check=True)
        serve = Serve(tmp)
        try:
            r = subprocess.run([exe, "roundtrip"], env=dict(os.environ, CKPT_SIDECAR_SOCKET=serve.socket),
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
            serve.verify()
        finally:
            serve.stop()


def c_trainer(tmp):
    need_cc()
    exe = os.path.join(tmp, "cuda_trainer")
    if not os.path.exists(exe):
        libdir = os.path.dirname(LIB)
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-std=c99", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{REPO}/shim-c/include",
                        f"{REPO}/shim-c/tests/c/cuda_trainer.c", "-o", exe, f"-L{libdir}", "-lckpt",
                        f"-Wl,-rpath,{libdir}", "-l:libcuda.so.1"], check=True)
    return exe


def vmm_c():
    needs("vmm_fd", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        exe = c_trainer(tmp)
        serve = Serve(tmp)
        env = dict(os.environ, CKPT_SIDECAR_SOCKET=serve.socket)
        try:
            r = subprocess.run([exe, "vmm-unexportable"], env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in r.stdout, r.stdout + r.stderr
            r = subprocess.run([exe, "vmm-roundtrip"], env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
        finally:
            serve.stop()
    with tempfile.TemporaryDirectory() as tmp:
        exe = c_trainer(tmp)
        serve = Serve(tmp)
        env = dict(os.environ, CKPT_SIDECAR_SOCKET=serve.socket)
        try:
            r = subprocess.run([exe, "vmm-die-after-release"], env=env, capture_output=True, text=True, timeout=300)
            assert "released" in r.stdout and r.returncode == -signal.SIGKILL, r.stdout + r.stderr
            deadline = time.monotonic() + 120
            while 5 not in serve.steps():
                assert time.monotonic() < deadline, "step 5 never committed: " + open(serve.log).read()[-4000:]
                time.sleep(0.1)
            serve.verify()
            r = subprocess.run([exe, "vmm-check"], env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
        finally:
            serve.stop()


def span_and_realloc_c():
    needs("vmm_fd", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        exe = c_trainer(tmp)
        serve = Serve(tmp)
        env = dict(os.environ, CKPT_SIDECAR_SOCKET=serve.socket)
        try:
            r = subprocess.run([exe, "span"], env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "ok" in r.stdout and r.stdout.count("refused: ") == 2, r.stdout + r.stderr
            r = subprocess.run([exe, "realloc"], env=env, capture_output=True, text=True, timeout=300)
            if r.returncode == 20:
                results["bench"]["realloc_c"] = "inconclusive: the driver did not reuse the freed address"
            else:
                assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
            serve.verify()
        finally:
            serve.stop()


EXPANDABLE = textwrap.dedent("""
    import json, sys, warnings, torch
    import ckpt_sidecar as cs
    assert "expandable_segments:True" in __import__("os").environ["PYTORCH_CUDA_ALLOC_CONF"]
    ck = cs.Checkpointer(socket=sys.argv[1], spawn=False)
    # 7 MiB tensors: several cross the allocator's 20 MiB chunks of one segment.
    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return {f"t{i}": torch.randn(7 << 18, device="cuda", generator=g) for i in range(24)}
    inplace = []
    for step, seed in ((1, 11), (2, 12)):
        if step == 2:
            del state
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        state = make(seed)
        want = {k: v.cpu() for k, v in state.items()}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            h = ck.save(step, state)
        inplace.append(h.copied_bytes == 0)
        h.wait_durable(timeout=300)
        back = ck.load(step, map_location="cpu")
        for k, v in want.items():
            assert torch.equal(back[k], v), f"step {step}: {k} differs"
    ck.close()
    print(json.dumps({"ok": True, "inplace": inplace, "warnings": [str(x.message) for x in w]}))
""")


def expandable_segments_torch():
    needs("vmm_fd", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp)
        try:
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
            r = subprocess.run([sys.executable, "-c", EXPANDABLE, serve.socket], env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and '"ok": true' in r.stdout, r.stdout + r.stderr
            got = results["bench"]["expandable_segments_torch"] = json.loads(r.stdout.strip().splitlines()[-1])
            assert all(got["inplace"]), f"expandable segments did not go in place (a host copy in the trainer): {got}"
            serve.verify()
        finally:
            serve.stop()


HOOK_EXPANDABLE = textwrap.dedent("""
    import io, json, os, sys, torch
    import ckpt_sidecar._hook as hook
    assert "expandable_segments:True" in os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    hook.install()
    passes = [0]
    real_skip_data = torch.serialization.skip_data
    def counting_skip_data(*a, **k):
        passes[0] += 1
        return real_skip_data(*a, **k)
    torch.serialization.skip_data = counting_skip_data
    def original(obj):
        b = io.BytesIO()
        torch.save.__wrapped__(obj, b)
        return b.getvalue()
    # 7 MiB tensors: several cross the allocator's 20 MiB chunks of one segment.
    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return {f"t{i}": torch.randn(7 << 18, device="cuda", generator=g) for i in range(24)}
    out = {}
    for step, seed in ((1, 11), (2, 12)):
        if step == 2:
            del state
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        state = make(seed)
        want, cpu = original(state), {k: v.cpu() for k, v in state.items()}
        path = os.path.join(sys.argv[1], f"m{step}.pt")
        torch.save(state, path)
        for v in state.values():
            v.mul_(2.0)  # the next step's write, at once
        assert hook.flush(300)
        assert open(path, "rb").read() == want, f"step {step}: the hook's file differs from torch.save's"
        back = torch.load(path, map_location="cpu")
        assert all(torch.equal(back[k], v) for k, v in cpu.items()), f"step {step}: a tensor differs"
    out["cuda_after_two"] = hook.cuda_counts()
    assert out["cuda_after_two"] == {"device": 2, "fell_back": 0, "lost": 0}, out
    # CUDA is initialised: a CPU-only state goes the host way with no skip_data pass.
    before = passes[0]
    cpu_state = {k: v.cpu() for k, v in state.items()}
    path = os.path.join(sys.argv[1], "cpu.pt")
    torch.save(cpu_state, path)
    assert hook.flush(300)
    out["cpu_only_skip_data_passes"] = passes[0] - before
    assert out["cpu_only_skip_data_passes"] == 0 and open(path, "rb").read() == original(cpu_state), out
    print(json.dumps({"ok": True, **out}))
""")


def hook_expandable_segments():
    needs("vmm_fd", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp)
        try:
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", CKPT_SIDECAR_SOCKET=serve.socket)
            r = subprocess.run([sys.executable, "-c", HOOK_EXPANDABLE, tmp], env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and '"ok": true' in r.stdout, r.stdout + r.stderr
            results["bench"]["hook_expandable_segments"] = json.loads(r.stdout.strip().splitlines()[-1])
        finally:
            serve.stop()


def guard_stream_wait_c():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        exe = c_trainer(tmp)
        serve = Serve(tmp)
        try:
            r = subprocess.run([exe, "guard"], env=dict(os.environ, CKPT_SIDECAR_SOCKET=serve.socket),
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and "snapshot=saved" in r.stdout, r.stdout + r.stderr
        finally:
            serve.stop()


def guard_stream_wait_torch():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp, staging="4GiB")
        try:
            with cs.Checkpointer(socket=serve.socket, spawn=False) as ck:
                w = torch.randn(1 << 28, device="cuda")  # 1 GiB: the copy takes a while
                saved = w.cpu()
                p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
                opt = torch.optim.SGD([p], lr=0.1)
                p.grad = torch.ones(4, device="cuda")
                ck.guard(opt)
                torch.cuda.synchronize()
                h = ck.save(1, {"w": w})
                assert h.cuda_stream is not None, "a device-only save waits on its stream"
                opt.step()
                w.fill_(7.0)  # the step's write, on the current stream, right after the hook
                h.wait_durable(timeout=300)
                assert torch.equal(ck.load(1, map_location="cpu")["w"], saved), "the step's write leaked into the snapshot"
        finally:
            serve.stop()


def dcp_cuda():
    needs("ipc_mem", "ipc_event")
    import torch.distributed.checkpoint as dcp

    from ckpt_sidecar.dcp import SidecarReader, SidecarWriter

    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp, staging="3GiB")
        try:
            state = {f"t{i}": torch.randn(1 << 26, device="cuda") for i in range(4)}  # 1 GiB
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            want = {k: v.cpu() for k, v in state.items()}  # what torch's DefaultStager did on the trainer's thread
            torch.cuda.synchronize()
            cpu_copy_s = time.perf_counter() - t0
            w = SidecarWriter(serve.dir, step=1, socket=serve.socket, spawn=False)
            dcp.save(state, storage_writer=w, no_dist=True)
            assert w._checkpointer()._last.copied_bytes == 0, "dcp.save copied CUDA tensors to the host"
            # Warm: the first registration makes the sidecar's CUDA context.
            w.step = 2
            dcp.async_save({k: v[:1024] for k, v in state.items()}, storage_writer=w, no_dist=True).result()
            w.step = 3
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=w, no_dist=True)
            stall_s = time.perf_counter() - t0
            for v in state.values():
                v.add_(1.0)  # the next step, queued at once on the trainer's stream
            fut.result()
            copied = w._checkpointer()._last.copied_bytes
            w.close()
            results["bench"]["dcp_async_save_1gib"] = {"stall_ms": stall_s * 1e3, "cpu_copy_ms": cpu_copy_s * 1e3}
            print(f"dcp_cuda: async_save stall {stall_s * 1e3:.1f} ms, .cpu() of the same {cpu_copy_s * 1e3:.1f} ms",
                  flush=True)
            assert copied == 0, f"async_save copied {copied} bytes of CUDA tensors to the host"
            for step in (1, 3):
                got = {k: torch.zeros_like(v) for k, v in want.items()}
                dcp.load(got, storage_reader=SidecarReader(serve.dir, step=step, socket=serve.socket, spawn=False),
                         no_dist=True)
                for k, v in want.items():
                    assert torch.equal(got[k], v), f"step {step}: {k} differs from the state as saved"
            assert threshold("dcp_async_save_stall_ms", stall_s * 1e3, 0.5 * cpu_copy_s * 1e3, unit="ms"), \
                f"async_save stalled the trainer {stall_s * 1e3:.1f} ms, a .cpu() copy takes {cpu_copy_s * 1e3:.1f} ms"
        finally:
            serve.stop()


def status(serve):
    o = subprocess.run([BIN, "status", "--socket", serve.socket, "--json"], capture_output=True, text=True, timeout=60)
    assert o.returncode == 0, o.stdout + o.stderr
    return json.loads(o.stdout)


SIDECAR_KILLED = textwrap.dedent("""
    import json, os, signal, sys, time, torch
    import ckpt_sidecar as cs
    ck = cs.Checkpointer(socket=sys.argv[1], spawn=False)
    p = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda"))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    ck.guard(opt)
    state = {f"t{i}": torch.randn(1 << 26, device="cuda") for i in range(4)}  # 1 GiB
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sys.argv[3]))  # a long kernel: the save's copy cannot run before it ends
    t_sleep = time.monotonic()
    h = ck.save(1, state)
    opt.step()  # the guard: this stream now waits for the sidecar's copy
    os.kill(int(sys.argv[2]), signal.SIGKILL)
    t_kill = time.monotonic()
    p.grad.fill_(2.0)
    opt.step()  # the next step, on the same stream
    torch.cuda.synchronize()
    t_done = time.monotonic()
    print(json.dumps({"kill_to_step_done_s": t_done - t_kill, "kernel_started_s_before_kill": t_kill - t_sleep}), flush=True)
""")


def sidecar_killed_trainer_steps_on():
    # About 3 s of GPU time (calibrated): the copy is queued behind it for sure.
    needs("ipc_mem", "ipc_event")
    cycles = sleep_cycles(3.0)
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp, staging="2GiB")
        try:
            r = subprocess.run([sys.executable, "-c", SIDECAR_KILLED, serve.socket, str(serve.proc.pid), str(cycles)],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, "the trainer hung or failed: " + r.stdout + r.stderr
            got = results["bench"]["sidecar_killed"] = json.loads(r.stdout.strip().splitlines()[-1])
            # Within 5 s of the kill, beyond what was left of the long kernel.
            left_s = max(0.0, 3.0 - got["kernel_started_s_before_kill"])
            assert threshold("sidecar_killed_step_done_s", got["kill_to_step_done_s"], 5.0 + left_s, unit="s"), got
        finally:
            serve.stop()


TRAINER_KILLED = textwrap.dedent("""
    import os, sys, time, torch
    import ckpt_sidecar as cs
    ck = cs.Checkpointer(socket=sys.argv[1], spawn=False)
    state = {f"t{i}": torch.randn(1 << 26, device="cuda") for i in range(4)}  # 1 GiB
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sys.argv[2]))  # ~30 s: the save's event cannot complete before the kill
    h = ck.save(1, state)
    print("saved", flush=True)
    time.sleep(600)
""")


def trainer_killed_before_event():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp, staging="2GiB")
        try:
            proc = subprocess.Popen([sys.executable, "-c", TRAINER_KILLED, serve.socket, str(sleep_cycles(30.0))],
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            line = proc.stdout.readline()
            assert line.strip() == "saved", line + proc.stderr.read()
            deadline = time.monotonic() + 60
            while not status(serve)["sessions"]:
                assert time.monotonic() < deadline, "the trainer's session never showed"
                time.sleep(0.05)
            time.sleep(0.5)  # the Save reaches the sidecar (a message away)
            proc.kill()
            proc.wait()
            t_kill = time.monotonic()
            while True:
                st = status(serve)
                if not st["sessions"] and st["staging_used_bytes"] == 0:
                    break
                assert time.monotonic() - t_kill < 10, f"10 s after the trainer's death: {st}"
                time.sleep(0.1)
            results["bench"]["trainer_killed_session_end_s"] = time.monotonic() - t_kill
            threshold("trainer_killed_session_end_s", time.monotonic() - t_kill, 10.0, unit="s")
            assert serve.steps() == [], "nothing may commit"
        finally:
            serve.stop()


EMPTY_CACHE = textwrap.dedent("""
    import json, sys, torch
    import ckpt_sidecar as cs
    ck = cs.Checkpointer(socket=sys.argv[1], spawn=False)
    free, total = torch.cuda.mem_get_info()
    # Leave 4 GiB free (a filler holds the rest, never saved), then use 60 % of it.
    filler = torch.empty(max(free - (4 << 30), 0), dtype=torch.uint8, device="cuda")
    free, total = torch.cuda.mem_get_info()
    n = int(free * 0.6) // 4
    x = torch.randn(n, device="cuda")
    h = ck.save(1, {"x": x})
    assert h.copied_bytes == 0
    h.wait_durable(timeout=300)
    del x, h
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    y = torch.ones(n, device="cuda")  # 60 % again: only if the freed memory is free
    ck.save(2, {"y": y}).wait_durable(timeout=300)
    ck.close()
    print(json.dumps({"ok": True, "bytes": n * 4, "free_before": free}), flush=True)
""")


def empty_cache_frees_for_the_trainer():
    needs("ipc_mem", "ipc_event")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp, staging="3GiB")
        try:
            r = subprocess.run([sys.executable, "-c", EMPTY_CACHE, serve.socket], capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=""))
            assert r.returncode == 0 and '"ok": true' in r.stdout, r.stdout + r.stderr
        finally:
            serve.stop()


TWO_RANKS = textwrap.dedent("""
    import json, sys, torch
    import ckpt_sidecar as cs
    ck = cs.Checkpointer(socket=sys.argv[1], spawn=False)  # rank and world from RANK / WORLD_SIZE
    g = torch.Generator().manual_seed(7)
    cpu = {k: torch.randn(1 << 20, generator=g) for k in ("a", "b", "c", "d")}  # replicated: each rank saves its part
    state = {k: v.cuda() for k, v in cpu.items()}  # on this rank's cuda:0, another GPU per rank
    ck.save(1, state).wait_durable(timeout=300)
    back = ck.load(1, map_location="cpu")
    assert all(torch.equal(back[k], v) for k, v in cpu.items())
    print(json.dumps({"ok": True, "rank": ck.rank, "device": torch.cuda.get_device_name(0)}), flush=True)
""")


def two_ranks_visible_devices():
    needs("ipc_mem", "ipc_event")
    if torch.cuda.device_count() < 2:
        raise Skip("one GPU: two ranks with different CUDA_VISIBLE_DEVICES orders need two")
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp)
        try:
            procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, serve.socket, str(r)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, CUDA_VISIBLE_DEVICES=vis, RANK=str(r), WORLD_SIZE="2"))
                     for r, vis in ((0, "0,1"), (1, "1,0"))]
            outs = [p.communicate(timeout=300) for p in procs]
            for p, (o, e) in zip(procs, outs):
                assert p.returncode == 0 and '"ok": true' in o, o + e
            serve.verify()
        finally:
            serve.stop()


def figures_issue_9():
    b = results["bench"]
    if "d2h_gib_per_s" not in b:
        raise AssertionError(f"the benchmark left no figures: {results['checks'].get('bench')}")
    # Each threshold recorded with its figure before any verdict.
    missed = [name for name, ok in (
        ("d2h_ratio_to_pinned_memcpy", threshold("d2h_ratio_to_pinned_memcpy", b["ratio_to_pinned_memcpy"], 0.8,
                                                 at_most=False)),
        ("save_cpu_ms", threshold("save_cpu_ms", b["save_cpu_ms"], 1.0, unit="ms")),
        ("step_slowdown", threshold("step_slowdown", b.get("step_slowdown"), 0.05)),
    ) if not ok]
    assert not missed, f"missed: {missed}: " + json.dumps({k: results["thresholds"][k] for k in missed})


def bench():
    needs("ipc_mem", "ipc_event")
    b = results["bench"]
    n_tensors, total = 32, 4 * GIB
    per = total // n_tensors
    state = {f"layer{i}": torch.randn(per // 2, device="cuda", dtype=torch.bfloat16) for i in range(n_tensors)}
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    # Baseline: a plain pinned cudaMemcpy of the same size, best of 3.
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        host.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, total / (time.perf_counter() - t0) / GIB)
    b["pinned_memcpy_gib_per_s"] = best
    del host, flat
    # A training step: bf16 matmuls, timed alone.
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step():
        t0 = time.perf_counter()
        for _ in range(4):
            x.copy_(torch.tanh(x @ x) * 0.01)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    step()
    alone = sorted(step() for _ in range(10))[5]
    b["step_alone_ms"] = alone * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        serve = Serve(tmp, staging="9GiB")
        try:
            with cs.Checkpointer(socket=serve.socket, spawn=False) as ck:
                ck.save(1, state).wait_durable(timeout=300)  # registers, page-locks staging
                rows = []
                for s in (2, 3):
                    torch.cuda.synchronize()
                    c0, t0 = time.thread_time(), time.perf_counter()
                    h = ck.save(s, state)
                    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
                    steps = []
                    while not h.released():
                        steps.append(step())
                    h.wait_released(timeout=300)
                    f = h.figures()
                    rows.append({"save_cpu_ms": cpu * 1e3, "save_wall_ms": wall * 1e3, "copy_s": f["copy_s"],
                                 "d2h_gib_per_s": total / f["copy_s"] / GIB,
                                 "step_during_copy_ms": (sorted(steps)[len(steps) // 2] * 1e3) if steps else None})
                    h.wait_durable(timeout=600)
                b["saves"] = rows
                best_row = max(rows, key=lambda r: r["d2h_gib_per_s"])
                b["d2h_gib_per_s"] = best_row["d2h_gib_per_s"]
                b["ratio_to_pinned_memcpy"] = best_row["d2h_gib_per_s"] / best
                b["save_cpu_ms"] = min(r["save_cpu_ms"] for r in rows)
                during = [r["step_during_copy_ms"] for r in rows if r["step_during_copy_ms"]]
                if during:
                    b["step_slowdown"] = min(during) / (alone * 1e3) - 1
        finally:
            serve.stop()
    print(json.dumps(b, indent=1), flush=True)


def main():
    check("checkpointer_roundtrip", checkpointer_roundtrip)
    check("hook_roundtrip", hook_roundtrip)
    check("sigkill_after_released_commits", sigkill_after_released_commits)
    check("restore_to_gpu_c", restore_to_gpu_c)
    check("vmm_c", vmm_c)
    check("guard_stream_wait_c", guard_stream_wait_c)
    check("guard_stream_wait_torch", guard_stream_wait_torch)
    check("span_and_realloc_c", span_and_realloc_c)
    check("expandable_segments_torch", expandable_segments_torch)
    check("hook_expandable_segments", hook_expandable_segments)
    check("sidecar_killed_trainer_steps_on", sidecar_killed_trainer_steps_on)
    check("trainer_killed_before_event", trainer_killed_before_event)
    check("empty_cache_frees_for_the_trainer", empty_cache_frees_for_the_trainer)
    check("two_ranks_visible_devices", two_ranks_visible_devices)
    check("dcp_cuda", dcp_cuda)
    check("bench", bench)
    check("figures_issue_9", figures_issue_9)
    write_report()
    print(json.dumps(results["checks"], indent=1))
    return 1 if any(v.startswith("FAILED") for v in results["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
