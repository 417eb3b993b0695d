"""Several nodes on one machine: two `ckpt-sidecar launch --dir NODE_LOCAL
--shared SHARED -- torchrun --nnodes 2 --node-rank N --nproc-per-node 2`
(gloo, CPU), one per simulated node, each with its own socket and
node-local directory. The 4 ranks save a replicated state as balanced
parts; each node's sidecar writes its ranks' parts and markers into the
shared directory, and the sidecar of rank 0 commits. A single process
then loads the whole state from the shared directory. Trainers SIGKILLed
once every part was released still get their step committed."""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "dist" / "replicated_train.py"
sys.path.insert(0, str(HERE / "dist"))

from test_dist import load_single, shard_bytes, torchrun  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp_path, shared, step, mode, vocab=5000, timeout_s=None, node_args=lambda node: []):
    """Runs both simulated nodes at once; returns (their CompletedProcess-like
    (returncode, output) pairs, the ranks' results). `node_args(node)`: more
    options of node `node`'s sidecar."""
    from conftest import sidecar_bin

    port = free_port()
    env = dict(os.environ)
    env.pop("CKPT_SIDECAR_SOCKET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE / "dist"), env.get("PYTHONPATH", "")])
    if timeout_s is not None:
        env["CKPT_SIDECAR_PART_TIMEOUT_S"] = str(timeout_s)
    for f in tmp_path.glob("result-*.json"):
        f.unlink()
    shared.mkdir(exist_ok=True)
    procs = []
    for node in (0, 1):
        cmd = [sidecar_bin(), "launch", "--dir", str(tmp_path / f"node{node}"), "--shared", str(shared),
               "--staging", "128MiB", *node_args(node), "--", torchrun(), "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               str(WORKER), str(shared), str(step), mode, str(vocab)]
        log = open(tmp_path / f"node{node}-{mode}-{step}.log", "w+")
        procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    out = []
    for p, log in procs:
        rc = p.wait(timeout=600)
        log.seek(0)
        out.append((rc, log.read()))
        log.close()
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result-*.json"))]
    return out, results


def test_four_ranks_on_two_nodes_commit_one_balanced_checkpoint_that_loads_whole(tmp_path):
    from replicated_train import state

    shared = tmp_path / "shared"
    out, saved = two_nodes(tmp_path, shared, 3, "save", vocab=60000)
    assert [rc for rc, _ in out] == [0, 0], out[0][1][-3000:] + out[1][1][-3000:]
    assert [(s["rank"], s["world_size"]) for s in saved] == [(r, 4) for r in range(4)]
    step_dir = shared / "step-000000000003"
    per = shard_bytes(step_dir)
    assert sorted(per) == [f"rank-{r:05d}-of-00004" for r in range(4)], per
    assert max(per.values()) <= 1.1 * min(per.values()), per
    assert sorted(p.name for p in step_dir.glob("rank-*.done")) == [f"rank-{r:05d}.done" for r in range(4)]
    # The coordinator is node 0's sidecar (it serves rank 0), and says so.
    assert "coordinator of this step" in out[0][1] and "coordinator of this step" not in out[1][1]
    # Nothing of the step is left in flight, and no node kept it for itself.
    assert not [p for p in shared.iterdir() if p.name.startswith(".tmp-")]
    assert not list((tmp_path / "node1").glob("step-*"))
    got, want = load_single(shared), state(vocab=60000)
    assert got["note"] == "replicated" and set(got["model"]) == set(want)
    for k, v in want.items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k


def test_trainers_of_both_nodes_killed_after_every_part_was_released_still_commit(tmp_path):
    from replicated_train import state

    shared = tmp_path / "shared"
    out, _ = two_nodes(tmp_path, shared, 4, "killall")
    assert all(rc != 0 for rc, _ in out)  # torchrun reports its killed ranks
    assert (shared / "step-000000000004" / "model.safetensors.index.json").exists(), out[0][1][-3000:] + out[1][1][-3000:]
    assert (shared / "latest").read_text().strip() == "step-000000000004"
    got = load_single(shared)
    assert all(torch.equal(got["model"][k], v) for k, v in state().items())


def test_node_local_shards_stay_on_each_nodes_own_disk_and_the_step_loads_whole(tmp_path):
    """--node-local: each node's ranks' shards go to its own --dir, only
    blobs, markers and the index to the shared directory; the index names
    the node holding each file (before: every shard went to the shared
    directory)."""
    from replicated_train import state

    shared = tmp_path / "shared"
    out, saved = two_nodes(tmp_path, shared, 3, "save", node_args=lambda node: ["--node-local", "--node-id", f"node{node}"])
    assert [rc for rc, _ in out] == [0, 0], out[0][1][-3000:] + out[1][1][-3000:]
    assert [(s["rank"], s["world_size"]) for s in saved] == [(r, 4) for r in range(4)]
    step_dir = shared / "step-000000000003"
    assert not list(step_dir.glob("*.safetensors"))
    index = json.loads((step_dir / "model.safetensors.index.json").read_text())
    nodes = index["ckpt"]["nodes"]
    assert sorted(nodes) == ["node0", "node1"]
    for node, ranks in (("node0", (0, 1)), ("node1", (2, 3))):
        local = tmp_path / node / "node-step-000000000003"
        assert nodes[node]["dirs"] == [str(tmp_path.resolve() / node)]
        assert sorted(nodes[node]["files"]) == sorted(p.name for p in local.glob("*.safetensors"))
        assert sorted(shard_bytes(local)) == [f"rank-{r:05d}-of-00004" for r in ranks]
    assert not [p for p in shared.iterdir() if p.name.startswith(".tmp-")]
    # On this one machine, a sidecar that names no node reads each node's
    # files where the index recorded them: the whole state, bit-equal.
    got, want = load_single(shared), state()
    assert got["note"] == "replicated" and set(got["model"]) == set(want)
    for k, v in want.items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), k


def load_on_node0(tmp_path, shared, step, nproc, url):
    """Node 0 alone (node 1 gone): `launch --dir node0 --shared SHARED
    --node-id node0 --drain URL -- torchrun --nproc-per-node NPROC` loading
    step `step` on every rank and checking it (the worker's load mode)."""
    from conftest import sidecar_bin

    env = dict(os.environ)
    env.pop("CKPT_SIDECAR_SOCKET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE / "dist"), env.get("PYTHONPATH", "")])
    for f in tmp_path.glob("result-*.json"):
        f.unlink()
    cmd = [sidecar_bin(), "launch", "--dir", str(tmp_path / "node0"), "--shared", str(shared), "--node-id", "node0",
           "--drain", url, "--staging", "128MiB", "--", torchrun(), "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(shared), str(step), "load"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r, [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result-*.json"))]


def test_node_local_step_drains_and_loads_at_world_size_2_and_1_with_a_node_gone(tmp_path):
    """--shared with --drain file://R: each node uploads its own files, the
    node of rank 0 commits the remote step; with node 1's disk gone, node 0
    loads the step at world size 2 and 1, bit-equal, node 1's files from
    the drain target."""
    shared, remote = tmp_path / "shared", tmp_path / "remote"
    remote.mkdir()
    url = f"file://{remote}"
    out, _ = two_nodes(tmp_path, shared, 3, "save", node_args=lambda node: ["--node-id", f"node{node}", "--drain", url])
    assert [rc for rc, _ in out] == [0, 0], out[0][1][-3000:] + out[1][1][-3000:]
    assert not list((shared / "step-000000000003").glob("*.safetensors"))
    # Each launch exits once its drain settled: the step is committed remotely.
    rindex = json.loads((remote / "step-000000000003" / "model.safetensors.index.json").read_text())
    assert "nodes" not in rindex["ckpt"]
    # Every rank's shards are in the one remote step folder (how many shards
    # a rank's part takes is the layout's: incremental saves may split it),
    # and they are exactly the files the remote index lists.
    assert sorted(shard_bytes(remote / "step-000000000003")) == [f"rank-{r:05d}-of-00004" for r in range(4)]
    assert sorted(p.name for p in (remote / "step-000000000003").glob("*.safetensors")) == sorted(
        f["name"] for f in rindex["ckpt"]["files"])
    shutil.rmtree(tmp_path / "node1")
    for nproc in (2, 1):
        r, results = load_on_node0(tmp_path, shared, 3, nproc, url)
        assert [(x["rank"], x["world_size"], x["equal"]) for x in results] == [(i, nproc, True) for i in range(nproc)]
        assert "loading from the drain target: another node holds" in r.stdout + r.stderr
