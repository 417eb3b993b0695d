"""DCP's checkpoint_id through SidecarWriter / SidecarReader: a new id is the
folder the save goes to (the Checkpointer of the old folder closed, the new
one's sidecar joined or spawned), or refused before anything is written;
validate_checkpoint_id is FileSystemWriter's. And Checkpointer(dir=D) on a
rank of several joins the `serve` that holds D at another socket."""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")


def _run(tmp_path, code, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR") or k == "CKPT_SIDECAR_BIN"}
    env["CKPT_SIDECAR_SOCKET"] = str(tmp_path / "no-sidecar.sock")  # none at the default: each spawns its own
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_a_writer_reused_with_another_checkpoint_id_writes_there(tmp_path):
    # The reproduction.
    r = _run(tmp_path, """
        import torch
        import torch.distributed.checkpoint as dcp
        from ckpt_sidecar import Checkpointer
        from ckpt_sidecar.dcp import SidecarReader, SidecarWriter
        w = SidecarWriter("a", staging="32MiB")
        dcp.save({"x": torch.ones(3)}, storage_writer=w)
        dcp.save({"x": torch.full((3,), 2.)}, storage_writer=w, checkpoint_id="b")
        w.close()
        got = {"x": torch.zeros(3)}
        dcp.load(got, storage_reader=SidecarReader("b"))
        assert torch.equal(got["x"], torch.full((3,), 2.)), got
        r = SidecarReader("b")
        dcp.load(got, storage_reader=r, checkpoint_id="a")   # a reader's reset honours its id too
        assert torch.equal(got["x"], torch.ones(3)), got
        for d in ("a", "b"):
            with Checkpointer(dir=d) as ck:
                print(d, ck.list())
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert len(eval(lines["a"])) == 1 and len(eval(lines["b"])) == 1, r.stdout


def test_a_checkpoint_id_the_given_sidecar_does_not_hold_is_refused_before_writing(tmp_path, sidecar):
    r = _run(tmp_path, f"""
        import os, traceback, torch
        import torch.distributed.checkpoint as dcp
        from ckpt_sidecar import Checkpointer
        from ckpt_sidecar.dcp import SidecarWriter
        w = SidecarWriter({str(sidecar.dir)!r}, socket={sidecar.socket!r}, spawn=False)
        dcp.save({{"x": torch.ones(3)}}, storage_writer=w)
        try:
            dcp.save({{"x": torch.ones(3)}}, storage_writer=w, checkpoint_id="elsewhere")
            raise SystemExit("written into the sidecar's folder instead of 'elsewhere'")
        except BaseException as e:  # DCP wraps it in a CheckpointException (a BaseException)
            told = "".join(traceback.format_exception(e))
            assert "InvalidArgument: checkpoint_id 'elsewhere'" in told and "holds" in told, told
            print("refused")
        w.close()
        with Checkpointer(socket={sidecar.socket!r}, spawn=False) as ck:
            print("steps", len(ck.list()))   # only the first save's
    """)
    assert r.returncode == 0 and "refused" in r.stdout, r.stdout + r.stderr
    assert "steps 1" in r.stdout, r.stdout
    assert not (tmp_path / "elsewhere").exists()


def test_validate_checkpoint_id_is_filesystem_writers(tmp_path):
    import pathlib

    from ckpt_sidecar.dcp import SidecarReader, SidecarWriter
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    ro = tmp_path / "ro"
    ro.mkdir()
    for cid in (str(tmp_path / "new"), tmp_path / "new", pathlib.Path("/nowhere/x"), "s3://bucket/ckpt",
                "relative/dir", "/proc/sys/none/x"):
        assert SidecarWriter.validate_checkpoint_id(cid) == FileSystemWriter.validate_checkpoint_id(cid), cid
        assert SidecarReader.validate_checkpoint_id(cid) == FileSystemReader.validate_checkpoint_id(cid), cid
    assert not SidecarWriter.validate_checkpoint_id("s3://bucket/ckpt")


def test_a_rank_of_several_joins_the_serve_holding_its_folder_at_another_socket(tmp_path, sidecar):
    r = _run(tmp_path, f"""
        from ckpt_sidecar import Checkpointer
        with Checkpointer(dir={str(sidecar.dir)!r}) as ck:
            print(ck.socket)
    """, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == sidecar.socket, r.stdout
