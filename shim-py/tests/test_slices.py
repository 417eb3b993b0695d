"""Tensors split between ranks, described in the index (docs/format.md,
"Slices"): 4 rank processes (RANK/WORLD_SIZE, one sidecar, no
torch.distributed) save a replicated state whose large tensor is split
between them; the index describes it as one logical tensor with its
slices, it loads whole and bit-equal on 2 ranks and on 1, `inspect` shows
it, a flipped byte of a slice is caught by `verify` and by `load` in one
line naming the tensor and the file, and a checkpoint of the older form
(the split described only by the blob parts.pkl) still loads."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "dist" / "env_ranks.py"
OLD_FIXTURE = HERE / "fixtures" / "world2-parts-pkl"
sys.path.insert(0, str(HERE / "dist"))


def run_ranks(tmp_path, sidecar, world_size, mode, step, ckdir=None):
    """world_size processes RANK=0..world_size-1 against one sidecar; their
    result-RANK.json, by rank."""
    env = dict(os.environ)
    env.update({"CKPT_SIDECAR_SOCKET": sidecar.socket, "WORLD_SIZE": str(world_size),
                "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])})
    work = tmp_path / f"{mode}-{world_size}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(ckdir or sidecar.dir), str(step), mode], cwd=work,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world_size)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    return [json.loads((work / f"result-{r}.json").read_text()) for r in range(world_size)]


def cli(*args):
    from conftest import sidecar_bin

    return subprocess.run([sidecar_bin(), *args], capture_output=True, text=True, timeout=120)


def index_of(stepdir):
    return json.loads((stepdir / "model.safetensors.index.json").read_text())


def test_four_ranks_split_a_tensor_that_loads_whole_on_two_and_on_one(tmp_path, sidecar):
    from env_ranks import small_state

    saved = run_ranks(tmp_path, sidecar, 4, "save", 4)
    assert [s["world_size"] for s in saved] == [4] * 4
    stepdir = sidecar.dir / "step-000000000004"
    idx = index_of(stepdir)["ckpt"]
    # Slices (2) and digests (3: incremental saves, the default).
    assert idx["format_version"] == 3 and idx["world_size"] == 4
    w = idx["slices"]["model.embed.weight"]
    assert w["dtype"] == "F32" and w["shape"] == [96, 64]
    assert [s["rank"] for s in w["slices"]] == [0, 1, 2, 3], w
    assert w["slices"][0]["elems"][0] == 0 and w["slices"][-1]["elems"][1] == 96 * 64
    for a, b in zip(w["slices"], w["slices"][1:]):
        assert a["elems"][1] == b["elems"][0]
    for s in w["slices"]:
        assert s["file"].startswith(f"rank-{s['rank']:05d}-of-00004-") and idx["tensors"][s["tensor"]]["crc32c"] == s["crc32c"]
    blobs = {b["name"] for b in idx["blobs"]}
    assert "parts.pkl" not in blobs and "ckpt.slices.json" not in blobs, blobs

    loaded = run_ranks(tmp_path, sidecar, 2, "load", 4)
    assert [x.get("equal") for x in loaded] == [True, True], loaded
    loaded = run_ranks(tmp_path, sidecar, 1, "load", 4)
    assert loaded == [{"rank": 0, "equal": True}]
    # Any tensor by name, whole.
    from ckpt_sidecar import Checkpointer
    from ckpt_sidecar.errors import NotFound

    with Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        got = ck.load_tensors(["model.embed.weight", "model.bias"], step=4)
        with pytest.raises(NotFound, match="model.nope"):
            ck.load_tensors(["model.nope"], step=4)
        # Into a state's own tensors, the split one put together in place.
        target = {"model": {k: torch.zeros_like(v) for k, v in small_state()["model"].items()}, "note": ""}
        ptrs = {k: v.data_ptr() for k, v in target["model"].items()}
        assert ck.load_into(target, step=4) == 4
    want = small_state()["model"]
    for k, v in want.items():
        assert torch.equal(target["model"][k], v) and target["model"][k].data_ptr() == ptrs[k], k
    assert set(got) == {"model.embed.weight", "model.bias"}
    assert torch.equal(got["model.embed.weight"], want["embed.weight"]) and torch.equal(got["model.bias"], want["bias"])

    # The CLI sees the logical tensor with its slices, world size and ranks.
    r = cli("inspect", str(sidecar.dir), "4")
    assert r.returncode == 0, r.stderr
    assert "world size 4; rank 0: " in r.stdout and "rank 3: " in r.stdout, r.stdout
    lines = r.stdout.splitlines()
    at = next(i for i, l in enumerate(lines) if l.split()[:1] == ["model.embed.weight"])
    assert "F32" in lines[at] and "[96, 64]" in lines[at] and "4 slices" in lines[at], lines[at]
    for k in range(4):
        assert lines[at + 1 + k].split()[0] == "slice" and f"rank {k}" in lines[at + 1 + k], lines[at + 1: at + 5]
    assert not any(l.split()[:1] and "#elems[" in l.split()[0] for l in lines), r.stdout
    j = json.loads(cli("inspect", str(sidecar.dir), "4", "--json").stdout)
    t = j["logical"]["model.embed.weight"]
    assert t["shape"] == [96, 64] and [s["rank"] for s in t["slices"]] == [0, 1, 2, 3] and j["ckpt"]["world_size"] == 4
    assert set(j["logical"]) == {"model." + k for k in small_state()["model"]}
    row = json.loads(cli("ls", str(sidecar.dir), "--json").stdout)["checkpoints"][0]
    assert row["world_size"] == 4 and len(row["bytes_per_rank"]) == 4 and row["tensors"] == 5, row


def test_a_ranks_part_plan_is_reused_while_its_state_is_the_same_and_each_step_loads_as_saved(tmp_path, sidecar):
    # Each rank keeps its part's plan (its leaves, the split tensor's pieces,
    # its blobs) while the state's quick key matches: an edit in place is
    # saved through the kept plan, a new tensor makes a new one, and every
    # step loads whole as it was saved.
    from env_ranks import repeat_states

    out = run_ranks(tmp_path, sidecar, 2, "repeat", 10)
    assert [(o["reused"], o["replanned"], o["parts"]) for o in out] == [(True, True, 2)] * 2, out
    from ckpt_sidecar import Checkpointer

    with Checkpointer(socket=sidecar.socket, spawn=False) as ck:
        for step, want in zip((10, 11, 12, 13), repeat_states()):
            got = ck.load(step)
            assert set(got["model"]) == set(want["model"]), step
            for k, v in want["model"].items():
                assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), (step, k)
    assert index_of(sidecar.dir / "step-000000000012")["ckpt"]["slices"], "embed.weight is split between the ranks"


def test_a_flipped_byte_of_a_slice_is_named_by_verify_and_by_load(tmp_path, sidecar):
    run_ranks(tmp_path, sidecar, 4, "save", 5)
    stepdir = sidecar.dir / "step-000000000005"
    idx = index_of(stepdir)["ckpt"]
    s = idx["slices"]["model.embed.weight"]["slices"][2]
    path = stepdir / s["file"]
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + s["data_offsets"][0] + 5] ^= 0x10
    path.write_bytes(bytes(data))
    want = f'{s["file"]}: tensor "model.embed.weight": slice elems [{s["elems"][0]}, {s["elems"][1]}) of rank 2'

    r = cli("verify", str(sidecar.dir), "--step", "5")
    assert r.returncode == 3, r.stdout + r.stderr
    assert any(l.strip().startswith(want) and "checksum mismatch" in l for l in (r.stdout + r.stderr).splitlines()), r.stdout + r.stderr

    got = run_ranks(tmp_path, sidecar, 1, "load", 5)[0]
    assert "error" in got and want in got["error"] and "checksum mismatch" in got["error"], got


def test_a_checkpoint_with_parts_pkl_written_before_slices_still_loads(tmp_path, sidecar):
    # Made by the code before the index described slices: two ranks, the
    # embedding saved in two pieces, listed by the blob parts.pkl.
    from env_ranks import small_state

    old = tmp_path / "old"
    shutil.copytree(OLD_FIXTURE, old)
    idx = index_of(old / "step-000000000003")["ckpt"]
    assert idx["format_version"] == 1 and "slices" not in idx
    assert {b["name"] for b in idx["blobs"]} >= {"parts.pkl"}
    assert sum("#elems[" in n for n in idx["tensors"]) == 2

    from ckpt_sidecar import Checkpointer

    with Checkpointer(dir=str(old), staging="64MiB") as ck:
        got = ck.load(3)
    want = small_state()
    assert got["note"] == want["note"]
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    with Checkpointer(dir=str(old), staging="64MiB") as ck:
        one = ck.load_tensors(["model.embed.weight"])
    assert torch.equal(one["model.embed.weight"], want["model"]["embed.weight"])
    assert cli("verify", str(old)).returncode == 0
