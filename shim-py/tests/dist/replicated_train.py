"""A torchrun worker (gloo, CPU) for test_dist.py: every rank builds the
same replicated transformer-like state from one seed and saves or loads it
through the sidecar in the environment. Each rank writes result-RANK.json
into the working directory."""
import json
import os
import sys

import torch
import torch.distributed as dist

from ckpt_sidecar import Checkpointer


def state(seed=0, d=256, layers=4, vocab=5000):
    g = torch.Generator().manual_seed(seed)
    s = {"embed.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        s[f"layers.{i}.attn.qkv.weight"] = torch.randn(3 * d, d, generator=g)
        s[f"layers.{i}.attn.qkv.bias"] = torch.randn(3 * d, generator=g)
        s[f"layers.{i}.attn.proj.weight"] = torch.randn(d, d, generator=g)
        s[f"layers.{i}.mlp.fc.weight"] = torch.randn(4 * d, d, generator=g).to(torch.bfloat16)
        s[f"layers.{i}.mlp.out.weight"] = torch.randn(d, 4 * d, generator=g).to(torch.bfloat16)
        s[f"layers.{i}.norm.weight"] = torch.ones(d)
    s["step"] = torch.tensor(7, dtype=torch.int64)
    return s


def main():
    """argv: DIR STEP MODE [VOCAB]. MODE: save (rng=True), load (restore_rng=True,
    checks the state), die (rank 1 is SIGKILLed before it saves, once rank 0's part is released), killall
    (every rank SIGKILLed once every part is released)."""
    d, step, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    vocab = int(sys.argv[4]) if len(sys.argv) > 4 else 5000
    dist.init_process_group("gloo")
    torch.manual_seed(1000 + dist.get_rank())
    ck = Checkpointer(dir=d)
    want = {"model": state(vocab=vocab), "note": "replicated"}
    out = {"rank": ck.rank, "world_size": ck.world_size, "step": step, "mode": mode}
    if mode == "save":
        h = ck.save(step, want, rng=True)
        h.wait_durable(timeout=120)
        out["rng_next"] = torch.rand(1).item()
    elif mode == "load":
        got = ck.load(step, restore_rng=True)
        assert got["note"] == "replicated" and set(got["model"]) == set(want["model"])
        for k, v in want["model"].items():
            assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k
        out["rng_next"] = torch.rand(1).item()
        out["equal"] = True
    elif mode == "die":
        # Rank 1 dies only once rank 0's part is in the sidecar: torchrun
        # stops the other ranks when one dies, and on a busy machine it
        # used to stop rank 0 before its save() was even sent.
        if ck.rank == 1:
            dist.barrier()
            os.kill(os.getpid(), 9)
        h = ck.save(step, want)
        h.wait_released(timeout=120)
        dist.barrier()
        try:
            h.wait_durable(timeout=120)
            out["durable"] = True
        except Exception as e:  # noqa: BLE001 - the point: it fails
            out["failed"] = str(e)
    elif mode == "killall":
        h = ck.save(step, want)
        # Copied at save(): released (and handed over to the sidecar) when
        # save() returns, so the part commits even though every rank is
        # killed before the sidecar may have copied it.
        h.wait_released(timeout=120)
        assert h.released()
        dist.barrier()
        os.kill(os.getpid(), 9)
    with open(f"result-{ck.rank}.json", "w") as f:  # in the launch's working directory
        json.dump(out, f)
    dist.barrier()
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
