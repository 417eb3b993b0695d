#!/usr/bin/env python3
"""A small transformer language model trained on CPU on synthetic data, with
checkpoints through the sidecar (ckpt_sidecar.Checkpointer).

Everything that decides the numbers is a function of the seed and the step:
torch.manual_seed, torch.use_deterministic_algorithms(True), one thread, and a
batch drawn from a generator seeded with (seed, step). A run that is killed
and resumed from its latest checkpoint (model, AdamW, LR scheduler, step,
config and the RNG states, which dropout consumes) therefore ends with the same
bits as a run that never stopped; `--out` writes the final parameters and
optimizer state with torch.save so two runs can be compared
(examples/python/compare.py).

Per checkpoint it prints the trainer's stall (inside save() plus the wait in
the guarded optimizer step) beside torch.save's time, with and without fsync,
for the same state.

Preemption: the Checkpointer is made with preemption=True, so SIGTERM (what a
cluster scheduler sends some seconds before it kills the job) does not end
the process; at the end of the step it reached, the trainer checkpoints that
step (unless it just did), waits until it is durable, and exits 0. A second
SIGTERM ends the process as usual.

  python train.py --dir ckpt --steps 60 --every 5 --kill-at 23   # dies after step 23 is released
  python train.py --dir ckpt --steps 60 --every 5 --term-at 37   # preempted at step 37: saves it, exits 0
  python train.py --dir ckpt --steps 60 --every 5 --resume --out resumed.pt
"""

import argparse
import math
import os
import signal
import sys
import tempfile
import time

import torch
import torch.nn as nn

import ckpt_sidecar as cs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="ckpt", help="checkpoint directory")
    p.add_argument("--socket", default=None, help="sidecar socket (default: the package's; spawned if none)")
    p.add_argument("--steps", type=int, default=60, help="train until this step (total, not more)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps (and at the last step)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --dir")
    p.add_argument("--kill-at", type=int, default=None, metavar="STEP",
                   help="SIGKILL this process at STEP (a crash); see --kill-phase")
    p.add_argument("--kill-phase", default="released", choices=["released", "saved", "forward"],
                   help="where at --kill-at: right after the sidecar released that step's save (it holds "
                        "its own copy: default), right after save() returns (the sidecar may not have it "
                        "yet), or in that step's forward pass")
    p.add_argument("--term-at", type=int, default=None, metavar="STEP",
                   help="send SIGTERM to this process in STEP's forward pass (a scheduler's preemption notice, "
                        "at a step of your choosing): it checkpoints STEP and exits 0")
    p.add_argument("--out", default=None, help="torch.save the final model and optimizer state here")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep")
    p.add_argument("--staging", default="256MiB",
                   help="staging memory of a spawned sidecar (allocated and pre-faulted at its start)")
    p.add_argument("--no-compare", action="store_true", help="skip the torch.save timing per checkpoint")
    p.add_argument("--share", action="store_true",
                   help="place the parameters in shared memory for good (ck.share): a save copies no parameters")
    p.add_argument("--quiet", action="store_true", help="only the summary lines")
    return p.parse_args(argv)


MODEL_KEYS = ("seed", "vocab", "d_model", "heads", "layers", "seq", "batch", "lr", "steps")


class TinyLM(nn.Module):
    def __init__(self, vocab, d_model, heads, layers, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x):
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.encoder(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def batch_at(cfg, step):
    """The batch of a step: a function of (seed, step) only, so a resumed run
    sees the same data in the same order. Sequences follow x[t+1] = (a*x[t] + b)
    mod vocab, with (a, b) drawn per sequence, so there is something to learn."""
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
    v, n, s = cfg["vocab"], cfg["batch"], cfg["seq"] + 1
    a = torch.randint(1, 4, (n, 1), generator=g)
    b = torch.randint(0, v, (n, 1), generator=g)
    x = torch.empty(n, s, dtype=torch.long)
    x[:, :1] = torch.randint(0, v, (n, 1), generator=g)
    for t in range(1, s):
        x[:, t : t + 1] = (a * x[:, t - 1 : t] + b) % v
    return x[:, :-1], x[:, 1:]


def lr_lambda_for(total):
    warmup = max(1, total // 10)

    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return f


def torch_save_times(state, near):
    """torch.save of the same state to a file beside the checkpoint dir:
    (seconds without fsync, seconds with flush + fsync)."""
    d = os.path.dirname(os.path.abspath(near)) or "."
    fd, path = tempfile.mkstemp(prefix=".torch-save-cmp-", suffix=".pt", dir=d)
    os.close(fd)
    try:
        t0 = time.perf_counter()
        torch.save(state, path)
        plain = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        synced = time.perf_counter() - t0
    finally:
        os.unlink(path)
    return plain, synced


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = {k: getattr(args, k) for k in MODEL_KEYS}
    say = (lambda *a, **k: None) if args.quiet else print

    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.d_model, args.heads, args.layers, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(args.steps))
    nparams = sum(p.numel() for p in model.parameters())

    # preemption=True: SIGTERM sets ck.preempted() instead of ending the process.
    ck = cs.Checkpointer(dir=args.dir, socket=args.socket, spawn=True, keep=args.keep,
                         staging=args.staging, preemption=True)
    if args.share:
        ck.share(model)
    ck.guard(opt)

    start = 1
    if args.resume:
        # A trainer killed after the sidecar's Released still gets that
        # checkpoint committed; with a long-lived sidecar it may be committing
        # now, so wait for it before asking for latest.
        deadline = time.monotonic() + 120
        while ck.status().get("in_flight") and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            state = ck.load(step="latest", map_location="cpu", restore_rng=True)
        except cs.SidecarError as e:
            print(f"resume: no checkpoint to resume from ({e}); starting at step 1")
            state = None
        if state is not None:
            if state["config"] != cfg:
                raise SystemExit(f"resume: checkpoint config {state['config']} != this run's {cfg}")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            sched.load_state_dict(state["sched"])
            start = state["step"] + 1
            print(f"resumed from step {state['step']} (latest in {args.dir})")
    print(f"model: {nparams} parameters, {args.layers} layers, d_model {args.d_model}; "
          f"steps {start}..{args.steps}, checkpoint every {args.every}", flush=True)

    def checkpoint_state(step):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "step": step, "config": cfg}

    stalls, saves_plain, saves_sync = [], [], []
    last = None  # (handle, step, loss, torch.save seconds or None)
    loss = None
    opt_shared = False

    def report(last):
        # The save's stall is known once the guarded optimizer step (or the end)
        # has waited for its release: time inside save() + time waiting.
        h, s, l, cmp = last
        stalls.append(h.stall_seconds)
        line = (f"step {s:5d}  loss {l:.4f}  checkpoint: stall {h.stall_seconds * 1e3:7.2f} ms"
                f" (save() + wait for release)")
        if cmp is not None:
            line += f"  | torch.save {cmp[0] * 1e3:7.2f} ms, +fsync {cmp[1] * 1e3:7.2f} ms"
        say(line, flush=True)

    t_train = time.perf_counter()
    for step in range(start, args.steps + 1):
        kill_here = args.kill_at == step
        x, y = batch_at(cfg, step)
        model.train()
        if kill_here and args.kill_phase == "forward":
            model(x)
            print(f"killing at step {step}, in the forward pass (SIGKILL)")
            die()
        if args.term_at == step:
            print(f"SIGTERM to this process at step {step}, in the forward pass (a preemption notice)", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # The guard's pre-step hook waits here for the last save's release;
        # forward and backward above overlapped the sidecar's copy.
        opt.step()
        sched.step()
        if last is not None:
            report(last)
            last = None

        saved = None  # this step's save, if it has one
        if step % args.every == 0 or step == args.steps:
            if args.share and not opt_shared:
                ck.share(opt.state)  # AdamW's moments too: the save then copies nothing here
                opt_shared = True
            state = checkpoint_state(step)
            cmp = None
            if not args.no_compare and not kill_here:
                # torch.save of the very same state, timed before the sidecar's
                # save so neither competes with the other.
                cmp = torch_save_times(state, args.dir)
                saves_plain.append(cmp[0])
                saves_sync.append(cmp[1])
            h = saved = ck.save(step, state, rng=True)
            last = (h, step, loss.item(), cmp)
            if kill_here and args.kill_phase == "saved":
                print(f"killing at step {step}, right after save() returned (SIGKILL)")
                die()
            if kill_here:
                # The sidecar's Released: it holds its own copy, so this step
                # commits although its trainer dies. (A save copied into shared
                # memory is released to the trainer when save() returns; the
                # sidecar takes it from there a moment later.)
                h.wait_taken()
                print(f"killing at step {step}, right after the sidecar released its checkpoint (SIGKILL)")
                die()
        elif kill_here:
            print(f"killing at step {step} (no checkpoint at this step; SIGKILL)")
            die()

        if ck.preempted():
            # SIGTERM: the job is killed soon. Checkpoint the step reached (the
            # same state and RNG a scheduled checkpoint of it would hold), wait
            # until it is durable, and stop cleanly; --resume goes on from it.
            if saved is None:
                if args.share and not opt_shared:
                    ck.share(opt.state)
                    opt_shared = True
                saved = ck.save(step, checkpoint_state(step), rng=True)
            saved.wait_durable()
            print(f"preempted (SIGTERM) at step {step}: checkpoint of step {step} committed, exiting 0", flush=True)
            ck.close()
            return

    if last is not None:
        last[0].wait_released()
        report(last)
        last[0].wait_durable()
    train_s = time.perf_counter() - t_train

    if stalls:
        st = sorted(stalls)
        line = (f"summary: {len(stalls)} checkpoints, trainer stall per checkpoint median "
                f"{st[len(st) // 2] * 1e3:.3f} ms (max {st[-1] * 1e3:.3f} ms)")
        if saves_plain:
            sp, ss = sorted(saves_plain), sorted(saves_sync)
            line += (f"; torch.save of the same state median {sp[len(sp) // 2] * 1e3:.3f} ms,"
                     f" with fsync {ss[len(ss) // 2] * 1e3:.3f} ms")
        print(line)
    print(f"done: step {args.steps}, final loss {loss.item() if loss is not None else float('nan'):.4f}, "
          f"{train_s:.2f} s")

    if args.out:
        torch.save({"step": args.steps, "model": model.state_dict(), "optim": opt.state_dict(),
                    "sched": sched.state_dict()}, args.out)
        print(f"wrote {args.out}")
    ck.close()


if __name__ == "__main__":
    main()
