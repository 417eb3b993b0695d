"""A rank without torch.distributed: RANK / WORLD_SIZE in the environment
and one sidecar for all (CKPT_SIDECAR_SOCKET). argv: DIR STEP MODE.
MODE save: saves small_state() (replicated; its large tensors are split
between ranks), rng=True, and waits until durable. MODE load: loads STEP
and writes {"rank", "equal"} to result-RANK.json in the working directory,
or {"error": one line} when the load fails."""
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
        else:
            try:
                out = {"rank": rank, "equal": equal(ck.load(step), small_state())}
            except Exception as e:  # noqa: BLE001 - the test reads the line
                out = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    with open(f"result-{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
