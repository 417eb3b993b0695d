"""Several ranks on one node: `ckpt-sidecar launch -- torchrun
--nproc-per-node 2` (gloo, CPU) saves a replicated state as two balanced
parts committed as one checkpoint, which loads whole in a single process
and per rank (RNG back) under torchrun again; a rank that dies before its
part means the step never commits; trainers killed after every part was
released still get their step committed."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "dist" / "replicated_train.py"
sys.path.insert(0, str(HERE / "dist"))


def torchrun():
    p = pathlib.Path(sys.executable).with_name("torchrun")
    if not p.exists():
        pytest.skip(f"skipped: no torchrun beside {sys.executable}")
    return str(p)


def launch(tmp_path, ckdir, step, mode, vocab=5000, nproc=2, env_extra=None, check=True):
    from conftest import sidecar_bin

    env = dict(os.environ)
    env.pop("CKPT_SIDECAR_SOCKET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE / "dist"), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    cmd = [sidecar_bin(), "launch", "--dir", str(ckdir), "--staging", "256MiB", "--",
           torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(WORKER), str(ckdir), str(step), mode, str(vocab)]
    for f in tmp_path.glob("result-*.json"):
        f.unlink()
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result-*.json"))]
    return r, results


def load_single(ckdir, step="latest"):
    """The whole state, in this process (world size 1, its own sidecar).
    Staging as small as the state allows: the default (a quarter of RAM,
    pre-faulted) got the spawned sidecar OOM-killed (-9) on a busy machine."""
    from ckpt_sidecar import Checkpointer

    with Checkpointer(dir=str(ckdir), staging="256MiB") as ck:
        assert ck.world_size == 1
        return ck.load(step)


def shard_bytes(stepdir):
    per = {}
    for f in stepdir.iterdir():
        if f.name.endswith(".safetensors"):
            per.setdefault(f.name[: len("rank-00000-of-00002")], 0)
            per[f.name[: len("rank-00000-of-00002")]] += f.stat().st_size
    return per


@pytest.mark.parametrize("vocab", [5000, 60000])
def test_two_ranks_save_balanced_parts_that_load_whole_and_per_rank(tmp_path, vocab):
    # vocab 60000: the embedding alone is more than half the state, so it is
    # saved in ranges by both ranks and put back together on load.
    from replicated_train import state

    ckdir = tmp_path / "ckpt"
    _, saved = launch(tmp_path, ckdir, 1, "save", vocab)
    assert [s["rank"] for s in saved] == [0, 1] and all(s["world_size"] == 2 for s in saved)
    per = shard_bytes(ckdir / "step-000000000001")
    assert set(per) == {"rank-00000-of-00002", "rank-00001-of-00002"}, per
    a, b = per.values()
    assert abs(a - b) <= 0.1 * max(a, b), per
    index = json.loads((ckdir / "step-000000000001" / "model.safetensors.index.json").read_text())
    assert index["ckpt"]["world_size"] == 2
    split = any("#elems[" in name for name in index["ckpt"]["tensors"])
    assert split == (vocab == 60000)

    got = load_single(ckdir)
    want = state(vocab=vocab)
    assert got["note"] == "replicated" and set(got["model"]) == set(want)
    for k, v in want.items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k

    # torch's HuggingFaceStorageReader reads the shards as plain safetensors:
    # whole tensors under their names (ranges stay apart, under theirs).
    hf = getattr(pytest.importorskip("torch.distributed.checkpoint"), "HuggingFaceStorageReader", None)
    if hf is not None and not split:
        import warnings

        step_dir = str(ckdir / "step-000000000001")
        md = hf(step_dir).read_metadata()
        sd = {k: torch.zeros(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: a single process"
            torch.distributed.checkpoint.load(sd, storage_reader=hf(step_dir))
        assert all(torch.equal(sd["model." + k], v) for k, v in want.items())

    # Same world size: every rank gets the whole state and its own RNG back.
    _, loaded = launch(tmp_path, ckdir, 1, "load", vocab)
    assert [x["equal"] for x in loaded] == [True, True]
    assert [x["rng_next"] for x in loaded] == [x["rng_next"] for x in saved]
    assert loaded[0]["rng_next"] != loaded[1]["rng_next"]


def test_four_ranks_write_what_two_ranks_and_one_process_load_whole(tmp_path):
    from replicated_train import state

    ckdir = tmp_path / "ckpt"
    _, saved = launch(tmp_path, ckdir, 2, "save", 60000, nproc=4)
    assert [s["world_size"] for s in saved] == [4] * 4
    per = shard_bytes(ckdir / "step-000000000002")
    assert sorted(per) == [f"rank-{r:05d}-of-00004" for r in range(4)], per
    assert max(per.values()) <= 1.1 * min(per.values()), per
    _, loaded = launch(tmp_path, ckdir, 2, "load", 60000, nproc=2)
    assert [x["equal"] for x in loaded] == [True, True]
    got, want = load_single(ckdir), state(vocab=60000)
    assert all(torch.equal(got["model"][k], v) for k, v in want.items())


def test_a_rank_that_dies_before_its_part_means_the_step_never_commits(tmp_path):
    ckdir = tmp_path / "ckpt"
    launch(tmp_path, ckdir, 1, "save")
    r, _ = launch(tmp_path, ckdir, 2, "die", env_extra={"CKPT_SIDECAR_PART_TIMEOUT_S": "3"}, check=False)
    assert r.returncode != 0  # torchrun reports the killed rank
    # Given up by the coordinator: after the part timeout, or at once when
    # launch drains after torchrun ended (no part can come any more).
    assert "the step is not committed" in r.stderr + r.stdout, r.stderr[-3000:]
    names = sorted(p.name for p in ckdir.iterdir() if p.name.startswith((".tmp-", "step-")))
    assert names == ["step-000000000001"], names
    assert (ckdir / "latest").read_text().strip() == "step-000000000001"
    assert set(load_single(ckdir)["model"]) == set(load_single(ckdir, 1)["model"])


def test_trainers_killed_after_every_part_was_released_still_commit(tmp_path):
    ckdir = tmp_path / "ckpt"
    r, _ = launch(tmp_path, ckdir, 5, "killall", check=False)
    assert r.returncode != 0
    assert (ckdir / "step-000000000005" / "model.safetensors.index.json").exists(), r.stderr[-3000:]
    per = shard_bytes(ckdir / "step-000000000005")
    assert set(per) == {"rank-00000-of-00002", "rank-00001-of-00002"}
    from replicated_train import state

    got = load_single(ckdir)
    assert all(torch.equal(got["model"][k], v) for k, v in state().items())


def test_ddp_example_killed_after_a_release_resumes_bit_identical(tmp_path):
    from conftest import sidecar_bin

    example = HERE.parent.parent / "examples" / "python" / "ddp_train.py"
    env = dict(os.environ)
    env.pop("CKPT_SIDECAR_SOCKET", None)

    def run(ckdir, *args):
        cmd = [sidecar_bin(), "launch", "--dir", str(ckdir), "--staging", "64MiB", "--", torchrun(), "--standalone",
               "--nproc-per-node", "2", str(example), "--dir", str(ckdir), "--steps", "12", "--every", "3", *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    r = run(tmp_path / "a", "--out", str(tmp_path / "a.pt"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(tmp_path / "b", "--kill-at", "6")
    assert r.returncode != 0
    # Every part of step 6 was released before the kill: it committed.
    assert (tmp_path / "b" / "latest").read_text().strip() == "step-000000000006", r.stderr[-3000:]
    r = run(tmp_path / "b", "--resume", "--out", str(tmp_path / "b.pt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 6 (world size 2)" in r.stdout + r.stderr
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for i, s in a["optim"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b["optim"]["state"][i][k]), (i, k)


def test_partition_is_balanced_covers_every_byte_once_and_splits_few_tensors():
    from ckpt_sidecar.dist import bytes_per_rank, partition

    # GPT-2 small's shapes (F32), and a state whose embedding is most of it.
    gpt2 = [("wte", 50257 * 768 * 4, 4, True), ("wpe", 1024 * 768 * 4, 4, True)]
    for i in range(12):
        gpt2 += [(f"h.{i}.ln_1", 768 * 4, 4, True), (f"h.{i}.attn.c_attn.w", 768 * 2304 * 4, 4, True),
                 (f"h.{i}.attn.c_attn.b", 2304 * 4, 4, True), (f"h.{i}.attn.c_proj.w", 768 * 768 * 4, 4, True),
                 (f"h.{i}.mlp.c_fc.w", 768 * 3072 * 4, 4, True), (f"h.{i}.mlp.c_proj.w", 3072 * 768 * 4, 4, True),
                 (f"h.{i}.empty", 0, 4, True)]
    lopsided = [("embed", 10_000_000 * 2, 2, True), ("norm", 4096, 4, True), ("raw", 1000, 1, False)]
    for items in (gpt2, lopsided):
        sizes = {n: isz for n, _, isz, _ in items}
        total = sum(n for _, n, _, _ in items)
        for w in (1, 2, 3, 4, 8):
            parts = partition(items, w)
            per = bytes_per_rank(parts, sizes, w)
            assert sum(per) == total
            assert max(per) <= 1.1 * min(per), (w, per)
            assert sum(len(p) > 1 for p in parts.values()) <= w - 1
            for (name, n, isz, _), pieces in zip(items, (parts[i[0]] for i in items)):
                # Contiguous element ranges covering the tensor once, in rank order.
                assert pieces[0].start == 0 and pieces[-1].stop == n // isz, name
                assert all(a.stop == b.start and a.rank < b.rank for a, b in zip(pieces, pieces[1:])), name


def test_a_rank_without_a_node_sidecar_is_told_how_to_launch(tmp_path, monkeypatch):
    from ckpt_sidecar import Checkpointer
    from ckpt_sidecar.errors import ConnectFailed

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConnectFailed, match="ckpt-sidecar launch"):
        Checkpointer(dir=str(tmp_path / "ckpt"), socket=str(tmp_path / "none.sock"))
