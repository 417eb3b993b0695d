"""The drain tier: `serve --drain URL` uploads every committed step
after it is durable (phase Replicated), and a load reads a step the local
directories lack (or an older one than the target's) from the target.

file:// always; s3:// through tests/s3/serve.sh (moto), started here on a
free port: if it cannot start, the test fails (never skips). No sleeps as
synchronisation: every wait is on a condition, deadlines only bound a hang."""
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import ckpt_sidecar as cs
from ckpt_sidecar.errors import NotFound, Timeout
from ckpt_test_util import wait_until
from conftest import STAGING, Sidecar, sidecar_bin

REPO = Path(__file__).resolve().parents[2]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Drained(Sidecar):
    """conftest's sidecar, `serve --dir DIR --drain URL ...` (no --drain when
    `url` is None)."""

    def __init__(self, tmp_path, name, ckdir, url, *extra, env=None):
        super().__init__(tmp_path, args=([] if url is None else ["--drain", url]) + list(extra), name=name, ckdir=ckdir, env=env)
        self.url = url

    def drain(self):
        return self.status()["drain"]


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.stop()


def state(step, n=64 * 1024):
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(n).astype(np.float32), "b": np.arange(step, step + 100, dtype=np.int64), "meta": {"step": step}}


def assert_equal_state(got, want):
    assert set(got) == set(want)
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(got["b"], want["b"])
    assert got["meta"] == want["meta"]


class S3:
    """tests/s3/serve.sh PORT in the foreground, its `export` lines parsed."""

    def __init__(self, tmp_path, port=None):
        self.port = port or free_port()
        self.log = tmp_path / "s3.log"
        self.env = {}
        self.proc = subprocess.Popen(["bash", str(REPO / "tests/s3/serve.sh"), str(self.port)], stdout=subprocess.PIPE,
                                     stderr=open(self.log, "ab"), text=True, start_new_session=True)
        want = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP"}
        deadline = time.monotonic() + 300  # a first run installs moto
        while not want <= set(self.env):
            line = self.proc.stdout.readline()
            assert line, f"tests/s3/serve.sh ended before printing its exports: {self.log.read_text()}"
            assert time.monotonic() < deadline, "tests/s3/serve.sh printed no exports"
            if line.startswith("export "):
                k, _, v = line[len("export "):].strip().partition("=")
                self.env[k] = v.strip("'\"")
        wait_until(lambda: self.proc.poll() is not None or self._accepts(), 120, "the S3 server accepting connections")
        assert self.proc.poll() is None, f"the S3 server exited: {self.log.read_text()}"

    def _accepts(self):
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def s3(tmp_path):
    s = S3(tmp_path)
    yield s
    s.stop()


def bar(tmp_path, servers, url, env=None):
    """The issue's Bar: saves 1..3, wait_replicated on each; L emptied; a new
    sidecar on the same drain loads `latest` = step 3, bit-equal."""
    local = tmp_path / "L"
    a = Drained(tmp_path, "a", local, url, env=env).start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        for step in (1, 2, 3):
            h = ck.save(step, state(step))
            h.wait_replicated(timeout=120)
            assert h.state() == "replicated"
    d = a.drain()
    assert d["last_replicated"] == 3 and d["state"] == "up" and d["skipped"] == [], d
    a.stop()
    shutil.rmtree(local)
    b = Drained(tmp_path, "b", local, url, env=env).start()
    servers.append(b)
    with cs.Checkpointer(socket=b.socket, spawn=False) as ck:
        got = ck.load("latest")
        assert (ck.last_load_step, ck.last_load_source) == (3, "drain")
        assert_equal_state(got, state(3))
        assert_equal_state(ck.load(2), state(2))
    # The log names where the step was read: the target's URL, not the local folder.
    loaded = [line for line in b.log.read_text().splitlines() if "loaded" in line and "step=3" in line]
    assert loaded and all("source=Drain" in line and url.split("?")[0] in line for line in loaded), loaded
    return b


def test_bar_file_drain_replicates_each_step_and_a_new_sidecar_restores_latest_from_the_drain(tmp_path, servers):
    remote = tmp_path / "R"
    remote.mkdir()
    bar(tmp_path, servers, f"file://{remote}")
    for step in (1, 2, 3):
        assert (remote / f"step-{step:012d}" / "model.safetensors.index.json").is_file()
    assert (remote / "latest").read_text().strip() == "step-000000000003"
    # R is an ordinary checkpoint directory: the CLI verifies it.
    out = subprocess.run([sidecar_bin(), "verify", str(remote), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_bar_s3_drain_replicates_each_step_ls_lists_them_and_a_new_sidecar_restores_latest(tmp_path, servers, s3):
    bar(tmp_path, servers, "s3://ckpt-test/run1", env=s3.env)
    out = subprocess.run([sidecar_bin(), "ls", "s3://ckpt-test/run1"], capture_output=True, text=True, env=dict(os.environ, **s3.env))
    assert out.returncode == 0, out.stdout + out.stderr
    listed = [int(w) for line in out.stdout.splitlines() for w in line.split()[:1] if w.isdigit()]
    assert listed == [1, 2, 3], out.stdout


def test_wait_replicated_without_a_drain_is_a_clear_error_not_a_hang(tmp_path, servers):
    a = Drained(tmp_path, "a", tmp_path / "L", None).start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        h = ck.save(1, state(1))
        h.wait_durable(60)
        with pytest.raises(NotFound, match="no drain target"):
            h.wait_replicated()
    assert a.status().get("drain") is None


def test_drain_every_k_replicates_multiples_only_and_refuses_to_wait_for_others(tmp_path, servers):
    remote = tmp_path / "R"
    remote.mkdir()
    a = Drained(tmp_path, "a", tmp_path / "L", f"file://{remote}", "--drain-every", "2").start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        h1 = ck.save(1, state(1))
        h1.wait_durable(60)
        with pytest.raises(NotFound, match="drain-every"):
            h1.wait_replicated(timeout=60)
        ck.save(2, state(2)).wait_replicated(timeout=60)
    assert sorted(p.name for p in remote.glob("step-*")) == ["step-000000000002"]


def test_start_with_an_unreachable_drain_is_one_clear_error_naming_the_url(tmp_path):
    port = free_port()  # nothing listens there
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    a = Drained(tmp_path, "a", tmp_path / "L", "s3://ckpt-test/run1", env=env)
    out = subprocess.run(a.command(), capture_output=True, text=True, env=a.env, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "s3://ckpt-test/run1" in out.stderr, out.stderr
    assert not Path(a.socket).exists()


def test_start_with_wrong_credentials_is_one_clear_error_naming_the_url_and_no_secret(tmp_path, s3):
    env = dict(s3.env, AWS_SECRET_ACCESS_KEY="not-the-secret-4242")  # serve.sh's moto checks signatures
    a = Drained(tmp_path, "a", tmp_path / "L", "s3://ckpt-test/run1", env=env)
    out = subprocess.run(a.command(), capture_output=True, text=True, env=a.env, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "s3://ckpt-test/run1" in out.stderr, out.stderr
    assert "not-the-secret-4242" not in out.stderr
    assert not Path(a.socket).exists()


def test_drain_target_gone_at_runtime_local_saves_go_on_and_replicated_is_never_claimed(tmp_path, servers):
    remote = tmp_path / "R"
    remote.mkdir()
    a = Drained(tmp_path, "a", tmp_path / "L", f"file://{remote}").start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, state(1)).wait_replicated(timeout=60)
        # The target breaks under the sidecar: its root is now a plain file.
        shutil.rmtree(remote)
        remote.write_text("not a directory")
        h2 = ck.save(2, state(2))
        h2.wait_durable(60)
        wait_until(lambda: a.drain()["state"] == "down", 60, "status saying the drain is down")
        h3 = ck.save(3, state(3))
        h3.wait_durable(60)
        assert (tmp_path / "L" / "step-000000000003" / "model.safetensors.index.json").is_file()
        with pytest.raises(Timeout):
            h3.wait_replicated(timeout=1.0)
        assert h3.state() == "durable"
        d = a.drain()
        assert d["last_replicated"] == 1 and d["error"], d
        # Back: the drain retries and replicates the newest, skipping 2.
        remote.unlink()
        remote.mkdir()
        h3.wait_replicated(timeout=120)
        with pytest.raises(NotFound, match="skipped"):
            h2.wait_replicated(timeout=60)
    assert a.drain()["state"] == "up"
    log = a.log.read_text()
    assert log.count("drain target down") == 1, log
    assert log.count("reachable again") == 1, log


def remote_step_dirs(remote):
    return sorted(p.name for p in remote.glob("step-*") if (p / "model.safetensors.index.json").exists())


def s3_client(env):
    import boto3

    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_REGION"])


def s3_keys(env, prefix):
    got = s3_client(env).list_objects_v2(Bucket="ckpt-test", Prefix=prefix)
    return sorted(o["Key"] for o in got.get("Contents", []))


def s3_uploads_in_progress(env, prefix):
    got = s3_client(env).list_multipart_uploads(Bucket="ckpt-test", Prefix=prefix)
    return got.get("Uploads", [])


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_sigkill_mid_upload_leaves_no_half_step_remotely_and_the_next_sidecar_replicates_it(tmp_path, servers, kind, request):
    remote = tmp_path / "R"
    remote.mkdir()
    env = None
    if kind == "s3":
        env = request.getfixturevalue("s3").env
        url = "s3://ckpt-test/kill"
        index_key = "kill/step-000000000001/model.safetensors.index.json"
        started = lambda: s3_uploads_in_progress(env, "kill/") or s3_keys(env, "kill/step-000000000001/")  # noqa: E731
        committed = lambda: index_key in s3_keys(env, "kill/")  # noqa: E731
    else:
        url = f"file://{remote}"
        started = lambda: any(p.is_file() for p in (remote / "step-000000000001").rglob("*"))  # noqa: E731
        committed = lambda: remote_step_dirs(remote) == ["step-000000000001"]  # noqa: E731
    big = {"w": np.random.default_rng(7).standard_normal(8 << 20).astype(np.float32)}  # 32 MiB: several parts
    a = Drained(tmp_path, "a", tmp_path / "L", url, "--drain-bandwidth", "4MB/s", env=env).start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, big).wait_durable(60)
    wait_until(lambda: a.drain()["uploading"] == 1 and started(), 60, "bytes of step 1 on the target")
    a.kill()
    assert not committed(), "a half-uploaded step must not be committed remotely"
    b = Drained(tmp_path, "b", tmp_path / "L", url, env=env).start()
    servers.append(b)
    wait_until(lambda: b.drain()["last_replicated"] == 1, 120, "the next sidecar replicating step 1")
    assert committed()
    if kind == "file":
        out = subprocess.run([sidecar_bin(), "verify", str(remote)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_retention_on_both_tiers_and_the_step_being_uploaded_is_never_deleted_locally(tmp_path, servers):
    remote, local = tmp_path / "R", tmp_path / "L"
    remote.mkdir()
    a = Drained(tmp_path, "a", local, f"file://{remote}", "--keep", "1", "--drain-keep", "2").start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        for step in (1, 2, 3, 4):
            ck.save(step, state(step)).wait_replicated(timeout=60)
    # Remote deletions follow Replicated, as local ones follow Durable.
    wait_until(lambda: remote_step_dirs(remote) == ["step-000000000003", "step-000000000004"], 60,
               lambda: f"--drain-keep 2 leaving steps 3 and 4 remotely: {remote_step_dirs(remote)}")
    assert sorted(p.name for p in local.glob("step-*")) == ["step-000000000004"]
    a.stop()
    # The step being uploaded is held from local retention (--keep 1).
    big = {"w": np.random.default_rng(8).standard_normal(2 << 20).astype(np.float32)}  # 8 MiB
    b = Drained(tmp_path, "b", local, f"file://{remote}", "--keep", "1", "--drain-bandwidth", "2MB/s").start()
    servers.append(b)
    with cs.Checkpointer(socket=b.socket, spawn=False) as ck:
        h5 = ck.save(5, big)
        h5.wait_durable(60)
        wait_until(lambda: b.drain()["uploading"] == 5, 60, "the upload of step 5 under way")
        ck.save(6, state(6)).wait_durable(60)
        assert (local / "step-000000000005" / "model.safetensors.index.json").is_file(), "the step under upload was deleted"
        h5.wait_replicated(timeout=120)


def test_damaged_remote_index_load_falls_back_to_the_previous_replicated_step_and_says_so(tmp_path, servers):
    remote, local = tmp_path / "R", tmp_path / "L"
    remote.mkdir()
    a = Drained(tmp_path, "a", local, f"file://{remote}").start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        for step in (1, 2):
            ck.save(step, state(step)).wait_replicated(timeout=60)
    a.stop()
    shutil.rmtree(local)
    idx = remote / "step-000000000002" / "model.safetensors.index.json"
    raw = bytearray(idx.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    idx.write_bytes(bytes(raw))
    b = Drained(tmp_path, "b", local, f"file://{remote}").start()
    servers.append(b)
    with cs.Checkpointer(socket=b.socket, spawn=False) as ck:
        got = ck.load("latest")
        assert_equal_state(got, state(1))
        said = ck.last_load_fell_back
        said = said if isinstance(said, str) else " ".join(said)
        assert "step 2" in said and "remote index damaged" in said, said


def test_launch_exits_only_once_the_last_step_is_replicated(tmp_path):
    # Before: launch exited as soon as the trainer's steps were durable
    # locally, so the last one never reached the drain target.
    import sys

    remote, local = tmp_path / "R", tmp_path / "L"
    remote.mkdir()
    trainer = tmp_path / "t.py"
    trainer.write_text(
        "import numpy as np, ckpt_sidecar as cs\n"
        "ck = cs.Checkpointer(spawn=False)\n"
        "for s in (1, 2):\n"
        "    ck.save(s, {'w': np.full(1 << 20, s, np.float32)}).wait_durable()\n"
        "ck.close()\n"
    )
    out = subprocess.run([sidecar_bin(), "launch", "--dir", str(local), "--staging", STAGING, "--drain", f"file://{remote}",
                          "--drain-bandwidth", "4MB/s", "--", sys.executable, str(trainer)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert remote_step_dirs(remote)[-1] == "step-000000000002", out.stderr
    assert (remote / "latest").read_text().strip() == "step-000000000002"


def test_a_damaged_local_step_is_loaded_from_the_drain_target_and_says_so(tmp_path, servers):
    remote, local = tmp_path / "R", tmp_path / "L"
    remote.mkdir()
    a = Drained(tmp_path, "a", local, f"file://{remote}").start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, state(1)).wait_replicated(timeout=60)
    a.stop()
    shard = max((local / "step-000000000001").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0x40
    shard.write_bytes(bytes(raw))
    b = Drained(tmp_path, "b", local, f"file://{remote}").start()
    servers.append(b)
    with cs.Checkpointer(socket=b.socket, spawn=False) as ck:
        assert_equal_state(ck.load(1), state(1))
        assert ck.last_load_source == "drain"
        said = ck.last_load_fell_back
        said = said if isinstance(said, str) else " ".join(said)
        assert "local copy damaged" in said, said
    # The damage the load found stays visible.
    damaged = b.status()["damaged"]
    assert [(d["step"], d["file"], d["found_by"]) for d in damaged] == [(1, shard.name, "load")], damaged


def wait_down_first(s, what):
    """The drain's report the first time `status` says down."""
    seen = []

    def down():
        seen.append(s.drain())
        return seen[-1]["state"] == "down"

    wait_until(down, 60, what)
    return seen[-1]


def test_a_file_target_that_fails_shows_down_at_the_first_failed_upload(tmp_path, servers):
    remote = tmp_path / "R"
    remote.mkdir()
    a = Drained(tmp_path, "a", tmp_path / "L", f"file://{remote}").start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, state(1)).wait_replicated(timeout=60)
        # Unwritable (the tests run as root, so not by its mode): a plain file now.
        shutil.rmtree(remote)
        remote.write_text("not a directory")
        ck.save(2, state(2)).wait_durable(60)
        d = wait_down_first(a, "status saying the drain is down")
    assert d["upload_failures"] == 1 and "step 2" in d["error"], d


def test_an_s3_target_stopped_shows_down_at_the_first_failed_upload_not_after_the_clients_retries(tmp_path, servers, s3):
    a = Drained(tmp_path, "a", tmp_path / "L", "s3://ckpt-test/down", env=s3.env).start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, state(1)).wait_replicated(timeout=120)
        s3.stop()
        ck.save(2, state(2)).wait_durable(60)
        d = wait_down_first(a, "status saying the drain is down")
    # Down at the first upload that failed, and that upload gave up after
    # object_store's bounded retries (2), not its default 10: the outage
    # shows within about a second.
    assert d["upload_failures"] == 1 and "step 2" in d["error"], d
    retries = re.findall(r"after (\d+) retries, max_retries: (\d+)", d["error"])
    assert retries and all(int(n) <= 2 and int(m) == 2 for n, m in retries), d["error"]


def test_s3_server_killed_and_restarted_mid_drain_local_saves_go_on_and_the_drain_resumes(tmp_path, servers, s3):
    a = Drained(tmp_path, "a", tmp_path / "L", "s3://ckpt-test/restart", env=s3.env).start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, state(1)).wait_replicated(timeout=120)
        s3.stop()
        h2 = ck.save(2, state(2))
        h2.wait_durable(60)
        wait_until(lambda: a.drain()["state"] == "down", 120, "status saying the drain is down")
        assert h2.state() == "durable"
        again = S3(tmp_path, port=s3.port)  # an empty server: the bucket made anew, step 1 gone with the old one
        try:
            h2.wait_replicated(timeout=120)
            assert "restart/step-000000000002/model.safetensors.index.json" in s3_keys(again.env, "restart/")
        finally:
            again.stop()
    assert a.drain()["state"] == "up"


def _dir_seen(d):
    """What a load may not change in directory d: its own mtime (any entry
    made or removed in it, a `.ckpt-fetch-*` folder included) and every
    path under it with its size and mtime."""
    return d.stat().st_mtime_ns, sorted((str(p.relative_to(d)), p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*"))


def _replicated_then_local_gone(tmp_path, servers, s3, url, steps):
    local = tmp_path / "L"
    a = Drained(tmp_path, "a", local, url, env=s3.env).start()
    servers.append(a)
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        for step in steps:
            ck.save(step, state(step)).wait_replicated(timeout=120)
    a.stop()
    shutil.rmtree(local)
    b = Drained(tmp_path, "b", local, url, env=s3.env).start()
    servers.append(b)
    return local, b


def test_a_remote_only_step_on_s3_is_streamed_into_the_load_with_nothing_written_to_the_local_dir(tmp_path, servers, s3):
    # Before: the step was copied into `.ckpt-fetch-*` in the primary, loaded
    # from there and removed (the primary's mtime moved, and the bytes were
    # written and read locally once more). Now every file is streamed into
    # the load's memory: LoadPacked (load) and Load (load_into) alike.
    local, b = _replicated_then_local_gone(tmp_path, servers, s3, "s3://ckpt-test/stream", (1, 2))
    before = _dir_seen(local)
    with cs.Checkpointer(socket=b.socket, spawn=False) as ck:
        assert_equal_state(ck.load("latest"), state(2))
        assert ck.last_load_step == 2
        assert_equal_state(ck.load(1), state(1))
        want = state(1)
        target = {"w": np.zeros_like(want["w"]), "b": np.zeros_like(want["b"]), "meta": {"step": 0}}
        got = ck.load_into(target, 1)
        assert got == 1, repr(got)
        np.testing.assert_array_equal(target["w"], want["w"])
        np.testing.assert_array_equal(target["b"], want["b"])
    assert _dir_seen(local) == before, "the load wrote to the local directory"
    assert not list(local.glob(".ckpt-fetch-*"))


def test_a_flipped_byte_in_a_remote_shard_on_s3_is_caught_while_streamed_and_named(tmp_path, servers, s3):
    local, b = _replicated_then_local_gone(tmp_path, servers, s3, "s3://ckpt-test/flip", (1,))
    client = s3_client(s3.env)
    objs = client.list_objects_v2(Bucket="ckpt-test", Prefix="flip/step-000000000001/")["Contents"]
    shard = max((o for o in objs if o["Key"].endswith(".safetensors")), key=lambda o: o["Size"])
    raw = bytearray(client.get_object(Bucket="ckpt-test", Key=shard["Key"])["Body"].read())
    raw[-100] ^= 0x40
    client.put_object(Bucket="ckpt-test", Key=shard["Key"], Body=bytes(raw))
    before = _dir_seen(local)
    with cs.Checkpointer(socket=b.socket, spawn=False) as ck:
        with pytest.raises(cs.errors.Damaged) as e:
            ck.load(1)
    said = str(e.value)
    assert "s3://ckpt-test/flip" in said and shard["Key"].rsplit("/", 1)[1] in said and "checksum mismatch" in said, said
    assert _dir_seen(local) == before


def test_every_committed_step_is_accounted_once_and_a_held_step_goes_once_replicated(tmp_path, servers):
    # Before: steps retention deleted before the drain reached them were in
    # none of replicated/backlog/skipped, and a step held for the drain
    # past --keep stayed after the drain went idle and after exit.
    remote, local = tmp_path / "R", tmp_path / "L"
    remote.mkdir()
    a = Drained(tmp_path, "a", local, f"file://{remote}", "--keep", "1", "--drain-bandwidth", "2MB/s").start()
    servers.append(a)
    big = {"w": np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)}  # 4 MiB: 2 s an upload
    steps = list(range(1, 9))
    with cs.Checkpointer(socket=a.socket, spawn=False) as ck:
        ck.save(1, big).wait_durable(60)
        wait_until(lambda: a.drain()["uploading"] == 1, 60, "the upload of step 1 under way")
        for step in steps[1:]:
            ck.save(step, state(step)).wait_durable(60)
        d = a.drain()
        waiting = d["backlog"] + ([d["uploading"]] if d["uploading"] is not None else [])
        assert not set(d["backlog"]) & (set(d["skipped"]) | set(d["deleted_undrained"])), d
        assert d["replicated_count"] + d["skipped_count"] + d["deleted_undrained_count"] + len(waiting) == len(steps), d
        ck.save(9, state(9)).wait_replicated(timeout=120)
    wait_until(lambda: a.drain()["backlog"] == [] and a.drain()["uploading"] is None, 60, "the drain idle")
    d = a.drain()
    assert d["replicated_count"] + d["skipped_count"] + d["deleted_undrained_count"] == 9, d
    assert d["deleted_undrained_count"] >= 1 and 9 in (d["last_replicated"],), d
    # Step 1, held past --keep 1 while it was uploaded, is gone once replicated.
    wait_until(lambda: sorted(p.name for p in local.glob("step-*")) == ["step-000000000009"], 30,
               lambda: f"--keep 1 once the drain is idle: {sorted(p.name for p in local.glob('step-*'))}")
    a.stop()
    assert sorted(p.name for p in local.glob("step-*")) == ["step-000000000009"]
