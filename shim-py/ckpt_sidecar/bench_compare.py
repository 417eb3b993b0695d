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
import gc
import json
import os
import shutil
import tempfile

import torch

from . import _bench_methods, _units
from ._bench_limits import fio, memcpy_s
from ._bench_loop import print_loop, run_loop
from ._bench_methods import (
    STEADY_SAVES,
    DcpMethod,
    DeepSpeedMethod,
    Sidecar,
    SidecarMethod,
    deepspeed_unavailable,
    safetensors_method,
    torch_save_method,
)
from ._bench_state import STATE_BYTES_MIN, log, make_lora_state, make_state, med, nbytes, train_adapters
from .checkpointer import Checkpointer


def parse_size(s):
    """A size as the command line takes it (_units: store/src/units.rs's meaning)."""
    try:
        return _units.parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    p.add_argument(
        "--scrub-interval",
        default=None,
        metavar="DURATION",
        help="with --loop/--loop-only: run the sidecar's loop again with `serve --scrub-interval DURATION` "
        "(the background scrub re-verifying committed steps) and print its overhead beside the loop without it",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="with --loop/--loop-only: run the sidecar's loop twice more as node a of two nodes (`serve --shared S "
        "--node-local`): alone, then with node b's sidecar as its peer (`--peer-replicas 1`, every step replicated "
        "into b's memory), and print both",
    )
    p.add_argument(
        "--peer-bandwidth",
        default=None,
        metavar="SIZE/s",
        help="with --peers: run the loop with the peer once more, node a's replication paced by "
        "`serve --peer-bandwidth SIZE/s`, and print it beside the unpaced one",
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
    if a.peer_bandwidth is not None and not a.peers:
        p.error("--peer-bandwidth paces the loop with a peer: it needs --peers")
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
    want = _methods_wanted(args)
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
    side = ck = None
    reuse = {"ds": None}  # one DeepSpeed writer for every size
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
            rows, entry, step = _run_size(args, base, size, want, ck, ck_trust, reuse, step)
            limits.append(entry)
            results.extend(rows)
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
        loop_scrub = None
        if loop is not None and args.scrub_interval:
            loop_scrub = run_loop(args, base, skipped, extra=("--scrub-interval", args.scrub_interval))
        loop_peers = _peer_loops(args, base, skipped) if loop is not None and args.peers else None
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
    if loop_scrub is not None:
        doc["loop_scrub"] = loop_scrub
    if loop_peers is not None:
        doc["loop_node_local"], doc["loop_peers"], paced = loop_peers
        if paced is not None:
            doc["loop_peers_paced"] = paced
    _report(args, doc, loop, loop_drain, loop_scrub, loop_peers)


def _methods_wanted(args):
    """The methods --methods names (default: every one these options allow);
    SystemExit naming an unknown one."""
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
    return want


def _run_size(args, base, size, want, ck, ck_trust, reuse, step):
    """Every method in `want` on a state of `size` bytes, with the limits
    beside them: (rows, the limits' entry, the last step used)."""
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
    methods = _methods_for(args, want, ck, ck_trust, state, changing, reuse)
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
            # A sidecar method also uses step + 1 (a steady one up to step + STEADY_SAVES).
            step += 2 + STEADY_SAVES
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
    rows = [_row(args, m, outs, methods, entry, size_b) for m, outs in samples.items()]
    return rows, entry, step


def _methods_for(args, want, ck, ck_trust, state, changing, reuse):
    """{method: its save of `state`, called as f(step, workdir)}; the sidecar's
    save regions reserved (or the state shared) first."""
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
            ds = reuse["ds"] = reuse["ds"] or DeepSpeedMethod()
            methods[m] = (lambda ds: lambda s, w: ds(s, state, w))(ds)
    return methods


def _row(args, m, outs, methods, entry, size_b):
    """Method `m`'s row for one size: medians of its samples `outs`, set
    beside the limits' `entry`."""
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
    if m == "deepspeed_fastpersist" and _bench_methods.DEEPSPEED_NOTE:
        row["note"] = _bench_methods.DEEPSPEED_NOTE
    return row


def _peer_loops(args, base, skipped):
    """--peers: the sidecar's loop on node a of two nodes, without then with
    node b's sidecar as its peer (each with a shared directory of its own)."""
    import socket

    from .bench_ranks import write_secret

    secret = write_secret(os.path.join(base, "peer-secret"))
    with socket.socket() as sa, socket.socket() as sb:
        sa.bind(("127.0.0.1", 0))
        sb.bind(("127.0.0.1", 0))
        pa, pb = sa.getsockname()[1], sb.getsockname()[1]

    def node(name, shared):
        os.makedirs(shared, exist_ok=True)
        return ("--shared", shared, "--node-local", "--node-id", name)

    log("the loop as node a of two nodes, alone")
    alone = run_loop(args, base, skipped, extra=node("a", os.path.join(base, "shared-alone")), tag="-alone")

    def with_peer(tag, paced):
        """The loop on node a with node b its peer (a's replication paced
        by `paced` when given), each time on a shared directory of its own."""
        shared = os.path.join(base, "shared" + tag)
        b_args = node("b", shared) + ("--peer-listen", f"127.0.0.1:{pb}", "--peers", f"127.0.0.1:{pa}")
        b = Sidecar(os.path.join(base, "node-b" + tag), 64 << 20, extra=b_args + ("--peer-secret-file", secret))
        try:
            b.connect().close()
            log(f"the loop as node a of two nodes, node b its peer{f', --peer-bandwidth {paced}' if paced else ''}")
            a_args = node("a", shared) + ("--peer-listen", f"127.0.0.1:{pa}", "--peers", f"127.0.0.1:{pb}")
            a_args += ("--peer-secret-file", secret) + (("--peer-bandwidth", paced) if paced else ())
            # The same step as alone: a loop timed by its own first persists
            # (the peer's pool not yet faulted) would run another step.
            return run_loop(args, base, skipped, extra=a_args, tag=tag, step_s=alone["step_compute_s"])
        finally:
            b.stop()

    peers = with_peer("-peers", None)
    paced = with_peer("-peers-paced", args.peer_bandwidth) if args.peer_bandwidth else None
    return alone, peers, paced


def _report(args, doc, loop, loop_drain, loop_scrub=None, loop_peers=None):
    """The table, the loop's, the plot and --json's document; a plot that
    failed is said last (SystemExit), after the figures."""
    if doc["results"]:
        print_table(doc)
    if loop is not None:
        print_loop(loop)
    if loop_drain is not None:
        print(f"with --drain {loop_drain['drain']}:")
        print_loop(loop_drain)
    if loop_scrub is not None:
        print(f"with --scrub-interval {args.scrub_interval}:")
        print_loop(loop_scrub)
    if loop_peers is not None:
        print("node a of two nodes (--shared --node-local), alone:")
        print_loop(loop_peers[0])
        print("node a of two nodes, node b its peer (--peer-replicas 1):")
        print_loop(loop_peers[1])
        if loop_peers[2] is not None:
            print(f"node a of two nodes, node b its peer, --peer-bandwidth {args.peer_bandwidth}:")
            print_loop(loop_peers[2])
    plot_failed = None
    if args.plot and doc["results"]:
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
            f"{r['method']:24s} {_units.human_bytes(r['size_bytes']):>9s} {fmt(r['stall_s']):>9s} "
            f"{fmt(r['durable_s']):>10s} "
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
