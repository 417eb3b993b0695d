"""A rank without torch.distributed: RANK / WORLD_SIZE in the environment
and one sidecar for all (CKPT_SIDECAR_SOCKET). argv: DIR STEP MODE.
MODE save: saves small_state() (replicated; its large tensors are split
between ranks), rng=True, and waits until durable. MODE load: loads STEP
and writes {"rank", "equal"} to result-RANK.json in the working directory,
or {"error": one line} when the load fails. MODE repeat: saves STEP to
STEP+3 of one state, edited in place before the third and given a new
tensor before the fourth (repeat_states), and writes whether the third
save reused the second one's plan and how many part plans are kept."""
import json
import os
import sys

import torch

from ckpt_sidecar import Checkpointer


def small_state(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(96, 64, generator=g),
            "proj.weight": torch.randn(64, 48, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(64),
            "bias": torch.randn(5, generator=g, dtype=torch.float64),
            "step": torch.tensor(7, dtype=torch.int64),
        },
        "note": "replicated",
    }


def repeat_states(seed=3):
    """The states MODE repeat saves as STEP to STEP+3 (the first twice, then
    an in-place edit of it, then a new bias tensor)."""
    a = small_state(seed)
    b = {"model": dict(a["model"]), "note": a["note"]}
    b["model"]["embed.weight"] = a["model"]["embed.weight"].clone()
    b["model"]["embed.weight"][0, 0] += 1
    c = {"model": dict(b["model"]), "note": b["note"]}
    c["model"]["bias"] = b["model"]["bias"] * 2
    return [a, a, b, c]


def equal(got, want):
    return got["note"] == want["note"] and set(got["model"]) == set(want["model"]) and all(
        got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v) for k, v in want["model"].items())


def main():
    d, step, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ.get("RANK", "0"))
    with Checkpointer(dir=d, spawn=False) as ck:
        assert ck.rank == rank, (ck.rank, rank)
        if mode == "save":
            ck.save(step, small_state(), rng=True).wait_durable(timeout=120)
            out = {"rank": rank, "world_size": ck.world_size}
        elif mode == "repeat":
            st = small_state()
            # Twice first: the first save maps the save region its copies go
            # to, which a plan depends on, so the second plans again.
            ck.save(step, st).wait_durable(timeout=120)
            ck.save(step + 1, st).wait_durable(timeout=120)
            first = ck._save_plans[-1]
            st["model"]["embed.weight"][0, 0] += 1  # in place: the same addresses, the plan kept
            ck.save(step + 2, st).wait_durable(timeout=120)
            reused = ck._save_plans[-1] is first
            st["model"]["bias"] = st["model"]["bias"] * 2  # another tensor: planned again
            ck.save(step + 3, st).wait_durable(timeout=120)
            parts = sum(p.part is not None for p in ck._save_plans)
            out = {"rank": rank, "reused": reused, "replanned": ck._save_plans[-1] is not first, "parts": parts}
        else:
            try:
                out = {"rank": rank, "equal": equal(ck.load(step), small_state())}
            except Exception as e:  # noqa: BLE001 - the test reads the line
                out = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    with open(f"result-{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
