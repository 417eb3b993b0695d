"""One rank of the peers tests: RANK / WORLD_SIZE in the environment, its
node's sidecar at CKPT_SIDECAR_SOCKET, no torch. argv: SHARED STEPS MODE.
MODE save: saves each step of STEPS (comma-separated) of state(step), each
waited durable and held by peers; writes {"rank", "held": [steps]}; MODE
try-save: the same, a failed wait_peers recorded as {"step", "error"} in
"held" instead. MODE replicate: save, then also wait_replicated (a drain). MODE
durable-then-peers: every step saved and waited durable first (after the
first, the file `go` awaited in the working directory), then each step's
wait_peers, recorded as in try-save.
MODE try-durable: saves each step, a failed wait_durable recorded as
{"step", "error"} in "failed" (the steps after it still saved). MODE load: loads "latest" and writes {"rank", "step", "equal",
"fell_back" (the load's RuntimeWarnings: what it passed over), "last_load_fell_back"}, or {"error": one line} when the load fails.
Each save writes the file durable-STEP-rRANK (in the working directory) once
durable, before it waits for the peers; PEER_RANKS_KIB sizes the state's
largest tensor (default 256 KiB)."""
import json
import os
import sys
import time
import warnings

import numpy as np

from ckpt_sidecar import Checkpointer


def state(step, kib=int(os.environ.get("PEER_RANKS_KIB", "256"))):
    g = np.random.default_rng(step)
    return {
        "w": g.standard_normal(kib * 256, dtype=np.float32),
        "v": g.integers(0, 1 << 30, size=(64, 33), dtype=np.int64),
        "step": np.array(step, dtype=np.int64),
    }


def equal(got, want):
    return set(got) == set(want) and all(
        got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v) for k, v in want.items())


def main():
    d, steps, mode = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], sys.argv[3]
    rank = int(os.environ["RANK"])
    with Checkpointer(dir=d, spawn=False) as ck:
        assert ck.rank == rank, (ck.rank, rank)
        if mode == "try-durable":
            out = {"rank": rank, "durable": [], "failed": []}
            for s in steps:
                try:
                    ck.save(s, state(s)).wait_durable(timeout=120)
                    out["durable"].append(s)
                except Exception as e:  # noqa: BLE001 - the test reads the line
                    out["failed"].append({"step": s, "error": f"{type(e).__name__}: {e}"})
        elif mode == "durable-then-peers":
            out = {"rank": rank, "held": []}
            handles = []
            for s in steps:
                handles.append(ck.save(s, state(s)).wait_durable(timeout=120))
                open(f"durable-{s}-r{rank}", "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists("go"):
                    assert time.monotonic() < deadline, "the test never said go"
                    time.sleep(0.01)
            for s, h in zip(steps, handles):
                try:
                    h.wait_peers(timeout=120)
                    out["held"].append(s)
                except Exception as e:  # noqa: BLE001 - the test reads the line
                    out["held"].append({"step": s, "error": f"{type(e).__name__}: {e}"})
        elif mode in ("save", "try-save", "replicate"):
            out = {"rank": rank, "held": []}
            for s in steps:
                h = ck.save(s, state(s)).wait_durable(timeout=120)
                open(f"durable-{s}-r{rank}", "w").close()
                try:
                    h.wait_peers(timeout=120)
                    out["held"].append(s)
                except Exception as e:  # noqa: BLE001 - the test reads the line
                    if mode != "try-save":
                        raise
                    out["held"].append({"step": s, "error": f"{type(e).__name__}: {e}"})
                if mode == "replicate":
                    h.wait_replicated(timeout=120)
        else:
            try:
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    got = ck.load("latest")
                s = int(got["step"])
                fell_back = " | ".join(str(w.message) for w in said if issubclass(w.category, RuntimeWarning))
                out = {"rank": rank, "step": s, "equal": equal(got, state(s)), "fell_back": fell_back,
                       "last_load_fell_back": ck.last_load_fell_back}
            except Exception as e:  # noqa: BLE001 - the test reads the line
                out = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    with open(f"result-{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
