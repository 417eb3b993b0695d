#!/usr/bin/env python3
"""A/B of sidecar builds or settings on bench.py's training-loop figure, alternated in one run
(the machine is noisy: compare variants measured minutes apart only through alternation).

  python loop_ab.py --variant A=BIN=/tmp/old/ckpt-sidecar --variant B=BIN=target/release/ckpt-sidecar

Per ckpt loop it prints the overhead against the mean of its neighbouring no-ckpt loops and what
makes it up: the trainer thread's CPU time (memory/cache interference, charged IRQ time), its
run-queue wait (schedstat: a core shared with the sidecar or kernel threads), time blocked in the
guarded optimizer step and in save(). Env keys PIN_T / PIN_S pin the trainer / sidecar (taskset
lists); AB_CPUS=1 prints per-CPU /proc/stat, virtio-blk IRQ and kernel-thread deltas.

--variant NAME=K1=V1,K2=V2 (env for the sidecar; BIN=path picks the binary; LAZY=0|1 sets the
client's lazy-release request). Each segment:
start the variant's sidecar, share, guard; `rounds` x (no-ckpt loop, ckpt loop), one more no-ckpt loop;
overhead of each ckpt loop against the mean of its neighbouring no-ckpt loops."""
import argparse, json, os, sys, time, threading, statistics, shutil
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import bench as B

p = argparse.ArgumentParser()
p.add_argument("--size-mib", type=int, default=512)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--cycles", type=int, default=3)
p.add_argument("--dir", default="/work/bench/barX")
p.add_argument("--factor", type=float, default=1.25)
p.add_argument("--variant", action="append", required=True)
p.add_argument("--kind", default="cpu", choices=["cpu", "gpu_like"])
args = p.parse_args()

tid = threading.get_native_id()
def sched():
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        a = f.read().split()
    return int(a[1]) / 1e9
def nr_migr():
    for line in open(f"/proc/self/task/{tid}/sched"):
        if line.startswith("se.nr_migrations"):
            return int(line.split(":")[1])
    return 0
def cpustat():
    out = {}
    for line in open("/proc/stat"):
        if line.startswith("cpu") and line[3].isdigit():
            f = line.split()
            out[f[0]] = [int(x) for x in f[1:9]]  # user nice system idle iowait irq softirq steal
    return out
def cpustat_delta(a, b):
    hz = os.sysconf("SC_CLK_TCK")
    names = ["usr", "nic", "sys", "idl", "iow", "irq", "sirq", "stl"]
    return {c: {n: round((b[c][i] - a[c][i]) / hz, 2) for i, n in enumerate(names) if b[c][i] != a[c][i]} for c in b}
def irqs():
    for line in open("/proc/interrupts"):
        if "virtio1-req" in line:
            f = line.split()
            return [int(f[1]), int(f[2])]
    return [0, 0]
def kthreads():
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        f = st.rsplit(")", 1)[1].split()
        ppid = int(f[1])
        if ppid == 2:
            out[f"{d}:{name}"] = int(f[11]) + int(f[12])
    return out
def sidecar_cpu(pid):
    s = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(s[11]) + int(s[12])) / os.sysconf("SC_CLK_TCK")

variants = []
for v in args.variant:
    name, _, rest = v.partition("=")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    variants.append((name, env))

state = B.make_state(args.size_mib)
size = B.nbytes_of(state)
ckdir = os.path.join(args.dir, "ckpt")
torch.set_num_threads(1)
a = torch.rand(384, 384)
def mm(n):
    x = a
    for _ in range(n):
        x = torch.mm(x, a).clamp_(0, 1)
n_mm = None
step = 0
results = {name: [] for name, _ in variants}
details = {name: [] for name, _ in variants}

def segment(name, env):
    global n_mm, step
    shutil.rmtree(ckdir, ignore_errors=True)
    old = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k not in ("BIN", "LAZY")})
    if "BIN" in env:
        os.environ["CKPT_SIDECAR_BIN"] = env["BIN"]
    side = B.Sidecar(ckdir, 2 * size + (256 << 20))
    os.environ.clear(); os.environ.update(old)
    if "PIN_S" in env:
        os.system(f"taskset -a -p -c {env['PIN_S']} {side.proc.pid} >/dev/null")
    os.system(f"taskset -a -p -c {env.get('PIN_T', '0,1')} {os.getpid()} >/dev/null")
    try:
        ck = side.connect()
        if "LAZY" in env:  # the client's lazy-release request (default on in the Python shim)
            from ckpt_sidecar import _native
            _native.check(_native.lib().ckpt_set_lazy_release(ck._client, int(env["LAZY"])))
        ck.share(state)
        params = [torch.nn.Parameter(t, requires_grad=False) for t in state.values()]
        opt = torch.optim.SGD(params, lr=0.0)
        ck.guard(opt)
        mark = {}
        opt.register_step_pre_hook(lambda o, a_, k: mark.__setitem__("h", time.perf_counter()))
        persist = []
        for _ in range(3):
            step += 1
            h = ck.save(step, state); h.wait_durable(); persist.append(h.figures()["persist_s"])
        if n_mm is None:
            target = args.factor * statistics.median(persist)
            t0 = time.perf_counter(); mm(20); n_mm = max(1, int(target / ((time.perf_counter() - t0) / 20)))
            for _ in range(3):
                t0 = time.perf_counter(); mm(n_mm); n_mm = max(1, round(n_mm * target / (time.perf_counter() - t0)))
            print(f"calibrated: persist {statistics.median(persist):.3f} s, step target {target:.3f} s, {n_mm} matmuls", file=sys.stderr)
        def work():
            if args.kind == "cpu":
                mm(n_mm)
            else:
                time.sleep(args.factor * 0.3)
        def run(ckpt):
            global step
            work()
            rq0, m0, c0 = sched(), nr_migr(), sidecar_cpu(side.proc.pid)
            ir0 = irqs(); kt0 = kthreads(); cs0 = cpustat(); tt0 = time.thread_time(); T0 = time.perf_counter()
            blk = sv = 0.0
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if ckpt:
                    step += 1
                    ck.save(step, state)
                sv += time.perf_counter() - t0
                work()
                t2 = time.perf_counter()
                opt.step()
                blk += mark["h"] - t2
            T = (time.perf_counter() - T0) / args.steps
            cs = cpustat_delta(cs0, cpustat())
            ir1 = irqs(); kt1 = kthreads()
            cs["irq36"] = [b - a for a, b in zip(ir0, ir1)]
            cs["kthreads"] = {k: v - kt0.get(k, 0) for k, v in kt1.items() if v - kt0.get(k, 0) > 0}
            tt = (time.thread_time() - tt0) / args.steps
            rq, mg = (sched() - rq0) / args.steps, nr_migr() - m0
            if ckpt:
                ck._last.wait_durable()
            return dict(step_s=T, cpu_s=tt, rq_s=rq, migr=mg, side_cpu=sidecar_cpu(side.proc.pid) - c0, cpus=cs, block_ms=1e3 * blk / args.steps, save_ms=1e3 * sv / args.steps)
        seq = [run(False)]
        for _ in range(args.rounds):
            seq.append(run(True)); seq.append(run(False))
        for i in range(1, len(seq), 2):
            b = (seq[i - 1]["step_s"] + seq[i + 1]["step_s"]) / 2
            bc = (seq[i - 1]["cpu_s"] + seq[i + 1]["cpu_s"]) / 2
            brq = (seq[i - 1]["rq_s"] + seq[i + 1]["rq_s"]) / 2
            ov = 100 * (seq[i]["step_s"] / b - 1)
            results[name].append(ov)
            d = dict(ov=ov, cpu_ov=100 * (seq[i]["cpu_s"] / bc - 1), rq_ms=1e3 * seq[i]["rq_s"], base_rq_ms=1e3 * brq,
                     migr=seq[i]["migr"], base_migr=(seq[i - 1]["migr"] + seq[i + 1]["migr"]) / 2,
                     side_cpu=seq[i]["side_cpu"], block_ms=seq[i]["block_ms"], save_ms=seq[i]["save_ms"], cpus=seq[i]["cpus"], base_cpus=seq[i-1]["cpus"], base_step=b, ck_step=seq[i]["step_s"])
            details[name].append(d)
            print(f"{name:>10}: overhead {ov:6.2f}%  trainer-cpu {d['cpu_ov']:+5.2f}%  rq/step {d['rq_ms']:6.1f} ms (base {d['base_rq_ms']:5.1f})  "
                  f"block {d['block_ms']:5.1f} ms save {d['save_ms']:4.1f} ms migr {d['migr']} (base {d['base_migr']:.0f})  sidecar cpu {d['side_cpu']:.2f} s  load {open('/proc/loadavg').read().split()[0]}",
                  file=sys.stderr, flush=True)
            if os.environ.get("AB_CPUS"):
                print(f"            ckpt {d['cpus']}\n            base {d['base_cpus']}", file=sys.stderr)
        ck.close()
    finally:
        side.stop()

for c in range(args.cycles):
    for name, env in (variants if c % 2 == 0 else variants[::-1]):
        segment(name, env)
summary = {}
for name, _ in variants:
    xs = results[name]
    summary[name] = dict(n=len(xs), median=statistics.median(xs), mean=statistics.mean(xs), min=min(xs), max=max(xs),
                         cpu_ov_median=statistics.median(d["cpu_ov"] for d in details[name]),
                         rq_ms_median=statistics.median(d["rq_ms"] for d in details[name]),
                         block_ms_median=statistics.median(d["block_ms"] for d in details[name]))
    print(f"== {name:>10}: overhead median {summary[name]['median']:.2f}% mean {summary[name]['mean']:.2f}% "
          f"[{summary[name]['min']:.2f}, {summary[name]['max']:.2f}] n={len(xs)}; trainer-cpu median {summary[name]['cpu_ov_median']:+.2f}%; "
          f"rq median {summary[name]['rq_ms_median']:.1f} ms/step; block median {summary[name]['block_ms_median']:.1f} ms/step", file=sys.stderr)
print(json.dumps(dict(args=vars(args), n_mm=n_mm, summary=summary, details=details)))
