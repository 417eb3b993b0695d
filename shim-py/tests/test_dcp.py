"""torch.distributed.checkpoint through the sidecar: dcp.save and
dcp.async_save with SidecarWriter on 2 ranks under `ckpt-sidecar launch --
torchrun` (gloo), then dcp.load with SidecarReader in one process with no
process group (resharding 2 ranks → 1), compared tensor by tensor with the
state and with DCP's own FileSystemWriter output of it."""
import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "dist"))


def template(world_size):
    from dcp_train import state

    s = {"rep": {"w": torch.zeros(300, 64), "b": torch.zeros(64, dtype=torch.bfloat16), "steps": torch.tensor(0),
                 "meta": {"epoch": 0, "name": ""}}}
    for r in range(world_size):
        s[f"own{r}"] = torch.zeros_like(state(r, world_size)[f"own{r}"])
    return s


def assert_same(got, want):
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, dict):
            assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_dcp_save_on_two_ranks_loads_in_one_process(tmp_path):
    from conftest import sidecar_bin
    from dcp_train import state

    from ckpt_sidecar.dcp import SidecarReader

    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip(f"skipped: no torchrun beside {sys.executable}")
    d, fsd = tmp_path / "ckpt", tmp_path / "fs"
    env = dict(os.environ)
    env.pop("CKPT_SIDECAR_SOCKET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE / "dist"), env.get("PYTHONPATH", "")])
    import subprocess

    r = subprocess.run([sidecar_bin(), "launch", "--dir", str(d), "--staging", "128MiB", "--", str(torchrun),
                        "--standalone", "--nproc-per-node", "2", str(HERE / "dist" / "dcp_train.py"), str(d), str(fsd)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    names = sorted(p.name for p in (d / "step-000000000000").iterdir())
    assert any(n.startswith("rank-00000-of-00002") for n in names), names
    assert any(n.startswith("rank-00001-of-00002") for n in names), names

    want = {**state(0, 2), **state(1, 2)}
    got = template(2)
    dcp.load(got, storage_reader=SidecarReader(d, step=0))
    assert_same(got, want)
    fs = template(2)
    dcp.load(fs, storage_reader=dcp.FileSystemReader(fsd))
    assert_same(got, fs)
    # async_save's step, the latest.
    got = template(2)
    dcp.load(got, storage_reader=SidecarReader(d))
    assert_same(got, {**state(0, 2, scale=2.0), **state(1, 2, scale=2.0)})


def test_dcp_async_save_stages_through_the_sidecar_writer_not_torchs_default_stager(sidecar):
    """async_save uses the writer as its stager only when the writer has every
    member of torch's runtime-checked AsyncStager protocol; without
    `should_synchronize_after_execute` torch's DefaultStager copied every
    tensor (CUDA ones too) to the CPU on the trainer's thread instead."""
    from torch.distributed.checkpoint.staging import AsyncStager

    from ckpt_sidecar.dcp import SidecarReader, SidecarWriter

    w = SidecarWriter(sidecar.dir, step=3, socket=sidecar.socket, spawn=False)
    assert isinstance(w, AsyncStager)
    staged = []
    stage = w.stage
    w.stage = lambda sd: staged.append(sorted(sd)) or stage(sd)
    live = {"w": torch.arange(1000, dtype=torch.float32), "meta": {"epoch": 2}}
    fut = dcp.async_save(live, storage_writer=w, no_dist=True)
    live["w"].add_(1000.0)  # after async_save returned: not in the checkpoint
    fut.result()
    w.close()
    assert staged == [["meta", "w"]]
    got = {"w": torch.zeros(1000), "meta": {"epoch": 0}}
    dcp.load(got, storage_reader=SidecarReader(sidecar.dir, step=3, socket=sidecar.socket, spawn=False), no_dist=True)
    assert torch.equal(got["w"], torch.arange(1000, dtype=torch.float32)) and got["meta"] == {"epoch": 2}


def test_a_writer_staging_device_memory_pickled_to_async_saves_process_executor_is_refused_not_a_hang(tmp_path):
    """async_save's PROCESS executor pickles the writer to its daemon, which
    would send the part from there: synchronize_staging would wait for a send
    this process never sees, and the tensors kept in place could change
    before the copy. Pickling refuses, and so does synchronize_staging, at
    once. (No driver needed: staging touches no device memory.)"""
    import pickle

    import ckpt_sidecar as cs
    from ckpt_sidecar.dcp import SidecarWriter

    class DeviceArray:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0x7000_0000, False), "version": 3,
                                    "strides": None, "stream": None}

    host = SidecarWriter(tmp_path / "ck")
    host.stage({"h": torch.ones(4)})
    assert not host.should_synchronize_after_execute
    assert pickle.loads(pickle.dumps(host)).dir == host.dir  # host state: the PROCESS executor works as before
    w = SidecarWriter(tmp_path / "ck")
    leaf = DeviceArray()
    assert w.stage({"d": leaf, "h": torch.ones(4)})["d"] is leaf
    assert w.should_synchronize_after_execute
    with pytest.raises(cs.InvalidArgument, match="AsyncCheckpointerType.THREAD"):
        pickle.dumps(w)
    with pytest.raises(cs.InvalidArgument, match="AsyncCheckpointerType.THREAD"):
        w.synchronize_staging()
