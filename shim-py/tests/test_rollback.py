"""Rollback: the timeline made explicit (issue: resuming from an older step).

A run that resumes from step 4 while 5..10 exist cannot save 5 again, and
`latest` would still point at the abandoned 10; `rollback` moves `latest`
first, then un-commits the later steps, after which they save again."""
import subprocess

import numpy as np
import pytest

import ckpt_sidecar as cs


def _state(step):
    return {"w": np.full(1024, step, np.float32), "step": step}


def test_rollback_through_the_checkpointer_then_later_steps_save_again(tmp_path):
    d = tmp_path / "ckpt"
    with cs.Checkpointer(dir=d, staging="64MiB") as ck:
        for step in range(1, 11):
            ck.save(step, _state(step)).wait_durable()
        with pytest.raises(cs.SidecarError, match="rollback"):
            ck.save(5, _state(5)).wait_durable()
        with pytest.raises(cs.NotFound):
            ck.rollback(11)
        assert ck.rollback(4) == 6
        assert ck.list() == [1, 2, 3, 4] and ck.latest() == 4
        for step in range(5, 9):
            ck.save(step, _state(1000 + step)).wait_durable()
        assert ck.latest() == 8
        got = ck.load("latest")
        assert got["step"] == 1008 and np.array_equal(got["w"], np.full(1024, 1008, np.float32))
    ls = subprocess.run([str(cs._native.sidecar_binary()), "ls", str(d), "--json"], capture_output=True, text=True, check=True)
    import json
    j = json.loads(ls.stdout)
    assert [c["step"] for c in j["checkpoints"]] == list(range(1, 9)) and j["latest"] == 8


def test_the_command_line_rolls_back_a_directory_then_a_checkpointer_saves_the_step_again(tmp_path):
    d = tmp_path / "ckpt"
    with cs.Checkpointer(dir=d, staging="64MiB") as ck:
        for step in range(1, 6):
            ck.save(step, _state(step)).wait_durable()
    out = subprocess.run([str(cs._native.sidecar_binary()), "rollback", str(d), "--to", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "un-committed 3" in out.stdout
    with cs.Checkpointer(dir=d, staging="64MiB") as ck:
        assert ck.list() == [1, 2]
        ck.save(3, _state(33)).wait_durable()
        assert ck.load("latest")["step"] == 33
