"""bench compare's training loop (--loop, --loop-only): a small model
trained step by step, checkpointing every step, every 10 steps, and never,
through each method; the slowdown of each against the plain loop beside it.
"""

import os
import tempfile
import time

import torch

from ._bench_limits import fsync_path
from ._bench_methods import DeepSpeedMethod, Sidecar
from ._bench_state import log, med

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


def run_loop(args, base, skipped, drain=None, extra=(), tag="", step_s=None):
    """A small model (an MLP of about --loop-size bytes of parameters, AdamW:
    three times that in state) trained --loop-steps steps, checkpointing every
    step, every 10 steps, and never, through each method. The step: a
    forward/backward of --loop-kind "gpu_like" (a sleep: an accelerator
    computes, the CPU is free) or "cpu" (single-thread matmuls), then the
    real optimizer step on the CPU. The step time is 1.25 x the sidecar's
    persist time (measured first), so a step is longer than a persist.
    Checkpointing loops alternate with plain ones; each is compared with the
    mean of its two neighbours; slowdown in %. `drain`, `extra`: the
    sidecar's loop only, its sidecar served with `--drain URL` or the extra
    serve options (the scrub); `tag` names its checkpoint directory apart;
    `step_s`: this step time instead of 1.25 x the persist (two loops
    compared at the same step)."""
    torch.set_num_threads(1)
    model, opt, fwd_bwd = _loop_model(args)
    side = Sidecar(
        os.path.join(base, "loop-ckpt" + ("-drain" if drain else "") + ("-extra" if extra else "") + tag),
        6 * args.loop_size + (256 << 20),
        drain=drain,
        extra=extra,
    )
    ck = side.connect()
    try:
        ck.share(model)
        ck.share(opt.state)
        ck.guard(opt)
        trust_tracker = None
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
        if step_s is None:
            step_s = max(0.02, 1.25 * med(persist))
        compute = _loop_compute(args.loop_kind, step_s, fwd_bwd)
        dcp_async = {"fut": None}

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
        if drain or extra:
            want = ["sidecar_shared"]  # the same loop, its sidecar draining every step to `drain`
        plain = [loop(None, 1)]
        savers = {m: _saver(m, os.path.join(base, f"loop-{m}"), ck, steps, trust_tracker, dcp_async) for m in want}
        samples = _loop_rounds(args, want, loop, savers, step_s, plain)
        out = {
            "drain": drain,
            "serve_extra": list(extra),
            "state_bytes": size_b,
            "steps": args.loop_steps,
            "kind": args.loop_kind,
            "step_compute_s": step_s,
            "sidecar_persist_s": med(persist),
            "never_step_s": med(plain),
            "never_runs": plain,
            "rows": _loop_rows(samples),
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


def _loop_model(args):
    """The loop's model and AdamW, one step taken (its moments exist), and
    its forward/backward: (model, optimizer, fwd_bwd)."""
    import torch.nn as nn

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
    return model, opt, fwd_bwd


def _loop_compute(kind, step_s, fwd_bwd):
    """A step's compute of about `step_s`: single-thread matmuls ("cpu") or
    a sleep (an accelerator computes), then fwd_bwd."""
    if kind == "cpu":
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

        return compute

    def compute():
        time.sleep(step_s)  # the accelerator computes
        fwd_bwd()

    return compute


def _saver(m, wd, ck, steps, trust_tracker, dcp_async):
    """Method `m`'s save of a loop state into folder `wd` (made here)."""
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
        return _torch_saver(m == "torch_save_fsync", wd)
    if m == "safetensors_fsync":
        return _safetensors_saver(wd)
    if m in ("dcp_save", "dcp_async_save"):
        return _dcp_saver(m == "dcp_async_save", wd, dcp_async)
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


def _torch_saver(fsync, wd):
    def f(st):
        path = os.path.join(wd, "state.pt")
        if not fsync:
            torch.save(st, path)
            return
        with open(path, "wb") as fh:
            torch.save(st, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_path(wd, True)

    return f


def _safetensors_saver(wd):
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


def _dcp_saver(is_async, wd, dcp_async):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix="bench-compare-pg-")
        dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
    n = iter(range(10**9))

    def f(st):
        path = os.path.join(wd, f"dcp-{next(n) % 2}")
        if not is_async:
            dcp.save(st, checkpoint_id=path)
        else:
            if dcp_async["fut"] is not None:
                dcp_async["fut"].result()  # one in flight at a time
            dcp_async["fut"] = dcp.async_save(st, checkpoint_id=path)

    return f


def _loop_rounds(args, want, loop, savers, step_s, plain):
    """--loop-rounds rounds, methods rotated, each checkpointing loop followed
    by a plain one (its step time appended to `plain`, which holds the one
    before): {(method, every): samples}."""
    samples = {(m, every): [] for m in want for every in (1, 10)}
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
                samples[(m, every)].append({"step_s": t, "never_step_s": never, "slowdown_pct": 100 * (t / never - 1)})
                log(
                    f"  {m} every {every}: {t * 1e3:.1f} ms/step vs {never * 1e3:.1f} never: "
                    f"{samples[(m, every)][-1]['slowdown_pct']:+.1f} %"
                )
    return samples


def _loop_rows(samples):
    return [
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
    rounds = loop["rows"][0]["rounds"] if loop["rows"] else 0
    print(f"{'method':24s} {'every':>5s} {'ms/step':>9s} {'slowdown':>9s}  (median of {rounds} rounds; each round's)")
    for r in loop["rows"]:
        each = " ".join(f"{x['slowdown_pct']:+.1f}" for x in r["samples"])
        print(f"{r['method']:24s} {r['every']:5d} {r['step_s'] * 1e3:9.1f} {r['slowdown_pct']:+8.1f}%  ({each})")
