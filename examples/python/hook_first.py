#!/usr/bin/env python3
"""The first torch.saves of an unmodified script through the import hook, beside plain torch.save.

  python hook_first.py [--size-mib 1024] [--saves 3] [--gap-s 8] [--dir /work/bench/h] [--json]

Each variant runs in a fresh interpreter (CKPT_SIDECAR=1 and no sidecar listening; or the hook off): it builds a state of --size-mib MiB of float32
tensors, then torch.saves it --saves times, --gap-s seconds apart (training between saves), and
reports each torch.save's duration, the wait at exit (hook: pending files) and who wrote the files.
The first save of a process is what this shows: a host state's file is written in place by the
trainer before torch.save returns, and synced afterwards by the hook's thread (no sidecar needed)."""
import argparse, json, os, subprocess, sys, tempfile, time

CHILD = r'''
import json, os, sys, time, torch
size, saves, gap, d = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
n = max(1, size // 16)
sd = {f"w{i}": torch.randn(4 << 20) for i in range(n)}  # 16 MiB each
out = {"save_s": []}
for k in range(saves):
    t = time.perf_counter()
    torch.save(sd, os.path.join(d, f"s{k}.pt"))
    out["save_s"].append(round(time.perf_counter() - t, 3))
    if k + 1 < saves:
        time.sleep(gap)
if hasattr(torch, "_ckpt_sidecar_flush"):
    from ckpt_sidecar import _hook
    t = time.perf_counter()
    _hook.flush()
    out["flush_s"] = round(time.perf_counter() - t, 3)
    out["counts"] = _hook.counts()
print(json.dumps(out))
'''

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--size-mib", type=int, default=1024)
p.add_argument("--saves", type=int, default=3)
p.add_argument("--gap-s", type=float, default=8.0)
p.add_argument("--dir", default=None)
p.add_argument("--json", action="store_true")
a = p.parse_args()
d = a.dir or tempfile.mkdtemp(prefix="hook-first-")
os.makedirs(d, exist_ok=True)
res = {}
for name, hook in (("hook", "1"), ("plain", "0")):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env["CKPT_SIDECAR"] = hook
    env["CKPT_SIDECAR_SOCKET"] = os.path.join(d, "no-sidecar.sock")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, str(a.size_mib), str(a.saves), str(a.gap_s), d],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{name}: exit {r.returncode}: {r.stderr[-2000:]}")
    res[name] = json.loads(r.stdout.strip().splitlines()[-1])
    res[name]["process_s"] = round(time.perf_counter() - t, 3)
    if not a.json:
        print(f"{name:6} torch.save s: {res[name]['save_s']}  process {res[name]['process_s']} s"
              + (f"  at exit {res[name]['flush_s']} s  written by {res[name]['counts']}" if "counts" in res[name] else ""))
    time.sleep(3)
if a.json:
    print(json.dumps({"size_mib": a.size_mib, "gap_s": a.gap_s, **res}))
