"""Peers (docs/guide.md, "Peers"): two sidecars on one machine as two
nodes (`serve --shared S --node-local --dir L_x --node-id x --peer-listen
127.0.0.1:P_x --peers 127.0.0.1:P_y --peer-secret-file K`), rank 0 on a,
rank 1 on b (RANK, WORLD_SIZE=2). Each step is waited durable and held by
peers; b's sidecar is then killed and its disk emptied, and a new one on
the empty disk serves both ranks' load("latest") bit-equal with no drain
target: b's files come from the replica a holds. A connection sending
garbage, one replaying a real peer's first bytes, and one with another
secret are refused, and saves still reach wait_peers."""
import hashlib
import hmac
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from ckpt_test_util import wait_until
from sidecar_fixtures import Sidecar, sidecar_bin

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "dist" / "peer_ranks.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secret_file(path, data=None):
    path.write_bytes(os.urandom(32) if data is None else data)
    path.chmod(0o600)
    return path


class Cluster:
    """Two nodes a and b, each a `serve` with peers, on a shared directory."""

    def __init__(self, tmp_path, secret):
        self.tmp = tmp_path
        self.shared = tmp_path / "shared"
        self.shared.mkdir(exist_ok=True)
        self.ports = {"a": free_port(), "b": free_port()}
        self.secret = secret
        self.nodes = {}

    def start(self, node, extra=(), peers=None, env=None):
        other = "b" if node == "a" else "a"
        peers = f"127.0.0.1:{self.ports[other]}" if peers is None else peers
        args = ["--shared", str(self.shared), "--node-local", "--node-id", node,
                "--peer-listen", f"127.0.0.1:{self.ports[node]}", "--peers", peers,
                "--peer-secret-file", str(self.secret), *extra]
        s = Sidecar(self.tmp, args=args, name=node, ckdir=self.tmp / f"L_{node}", env=env).start()
        self.nodes[node] = s
        return s

    def ranks(self, mode, steps="1", env_extra=None):
        """Rank 0 on a, rank 1 on b; their result files, by rank."""
        return self.finish(*self.start_ranks(mode, steps, env_extra))

    def dir_of(self, node):
        """The checkpoint directory a rank on `node` names: the shared one."""
        return self.shared

    def start_ranks(self, mode, steps="1", env_extra=None, ranks=(0, 1), fresh=True, world=2, on="ab"):
        """Starts rank r on node on[r] (rank 0 on a, rank 1 on b), for each r of `ranks`, in a world of
        `world`, in a working directory made anew (`fresh`) or kept; their processes and that directory."""
        work = self.tmp / f"work-{mode}-{steps}"
        if fresh:
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                   **(env_extra or {}), WORLD_SIZE=str(world))
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(self.dir_of(on[r])), steps, mode], cwd=work,
                                  env={**env, "RANK": str(r), "CKPT_SIDECAR_SOCKET": self.nodes[on[r]].socket},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in ranks]
        return procs, work

    def finish(self, procs, work, world=2):
        """The started ranks' result files, by rank, once all exited 0; and the logs."""
        outs = [p.communicate(timeout=300)[0] for p in procs]
        logs = "\n".join(o[-3000:] for o in outs) + self.logs()
        assert all(p.returncode == 0 for p in procs), logs
        return [json.loads((work / f"result-{r}.json").read_text()) for r in range(world)], logs

    def said(self, node, *words):
        """Whether a line of node's log holds every one of `words`."""
        return any(all(w in ln for w in words) for ln in self.nodes[node].log.read_text().splitlines())

    def wait_log(self, node, text, procs=(), step=None):
        """Waits until a line of node's log says `text` (of `step`, if given), the ranks `procs` still
        running (bounded: a hang fails)."""
        words = (text,) if step is None else (text, f"step={step}")

        def said():
            assert all(p.poll() is None for p in procs), f"a rank ended before {node} said {words!r}" + self.logs()
            return self.said(node, *words)

        wait_until(said, 120, lambda: f"{node} never said {words!r}" + self.logs())

    def logs(self):
        return "".join(f"\n--- {n}\n{s.log.read_text()[-4000:]}" for n, s in self.nodes.items())

    def stop(self):
        for s in self.nodes.values():
            s.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, secret_file(tmp_path / "K"))
    yield c
    c.stop()


def test_a_replaced_node_on_an_emptied_disk_loads_bit_equal_from_its_peer_without_a_drain(cluster, tmp_path):
    for n in ("a", "b"):
        cluster.start(n)
    saved, logs = cluster.ranks("save", "1,2")
    assert [s["held"] for s in saved] == [[1, 2], [1, 2]], logs
    # Each node's files are on its own disk only; each node holds the other's in RAM.
    for n, other in (("a", "b"), ("b", "a")):
        p = cluster.nodes[n].status()["peers"]
        assert p["last_held"] == 2 and p["last_held_by"] == [other], p
        assert sorted(map(tuple, p["holding"])) == [(other, 1), (other, 2)], p
    assert list((tmp_path / "L_b" / "node-step-000000000002").glob("*.safetensors"))
    # ls says where each node's files are: its directory, and which peer holds them in memory.
    peers = ",".join(f"127.0.0.1:{cluster.ports[n]}" for n in ("a", "b"))
    ls = subprocess.run([sidecar_bin(), "ls", str(cluster.shared), "--json", "--peers", peers,
                         "--peer-secret-file", str(cluster.secret)], capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    doc = json.loads(ls.stdout)
    assert sorted(p["node"] for p in doc["peers"]) == ["a", "b"], doc["peers"]
    for row in doc["checkpoints"]:
        for n, other in (("a", "b"), ("b", "a")):
            node = row["nodes"][n]
            assert node["dirs"] == [str(tmp_path / f"L_{n}")] and node["files"] >= 1 and node["held_by"] == [other], row
    text = subprocess.run([sidecar_bin(), "ls", str(cluster.shared), "--peers", peers, "--peer-secret-file",
                           str(cluster.secret)], capture_output=True, text=True, timeout=60).stdout
    assert "node b: 1 file" in text and "held by peers: a" in text, text
    cluster.nodes["b"].kill()
    shutil.rmtree(tmp_path / "L_b")
    (tmp_path / "L_b").mkdir()
    cluster.start("b")
    loaded, logs = cluster.ranks("load")
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(2, True, None)] * 2, logs
    assert "loading from the peers" in cluster.nodes["b"].log.read_text()
    # Nothing was written back to b's disk: its files were streamed into the load's memory.
    assert not list((tmp_path / "L_b").rglob("*.safetensors"))


def test_the_commit_takes_markers_by_message_from_the_coordinator_a_node_learned(cluster):
    """Step 1 teaches b where the coordinator is (a's Decided). Step 2: rank
    1 saves first, and its marker reaches a by message before rank 0's part
    is there; a keeps it, and commits with both markers taken from messages
    and its own report, none read from the shared directory. Then a's
    sidecar is replaced, and step 3's marker still reaches the new one."""
    debug = {"CKPT_SIDECAR_LOG": "info,ckpt_sidecar::commit::nodes=debug"}
    cluster.start("a", env=debug)
    cluster.start("b")
    saved, logs = cluster.ranks("save", "1")
    assert [s["held"] for s in saved] == [[1], [1]], logs
    cluster.wait_log("b", "markers go to this coordinator")
    assert f"coordinator=127.0.0.1:{cluster.ports['a']}" in cluster.nodes["b"].log.read_text()
    first, work = cluster.start_ranks("save", "2", ranks=(1,))
    cluster.wait_log("a", "came before this step's rank 0 part", first)
    second, _ = cluster.start_ranks("save", "2", ranks=(0,), fresh=False)
    saved, logs = cluster.finish(second + first, work)
    assert [s["held"] for s in saved] == [[2], [2]], logs
    durable = [ln for ln in cluster.nodes["a"].log.read_text().splitlines() if "this sidecar coordinated" in ln]
    assert len(durable) == 2 and "step=2" in durable[1] and "markers_sent=2" in durable[1], durable
    # a's sidecar replaced on the same port: b's kept connection to it is
    # stale, and its next marker still gets there (on a new one).
    cluster.nodes["a"].kill()
    cluster.start("a", env=debug)
    first, work = cluster.start_ranks("save", "3", ranks=(1,))
    cluster.wait_log("a", "kept for it step=3 rank=1", first)
    second, _ = cluster.start_ranks("save", "3", ranks=(0,), fresh=False)
    saved, logs = cluster.finish(second + first, work)
    assert [s["held"] for s in saved] == [[3], [3]], logs
    loaded, logs = cluster.ranks("load")
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(3, True, None)] * 2, logs


def test_a_coordinator_killed_mid_commit_fails_the_other_nodes_rank_in_time_and_a_new_one_commits_the_retry(
        cluster):
    """b knows a as the coordinator; a's sidecar is killed, and b's rank 1
    saves step 2: its doorbell finds no one, nothing hangs, and b fails the
    rank once twice the part timeout passed with no decision. A new sidecar
    for a (same port), and both ranks save step 2 again: it commits, with
    b's marker taken by message, and loads bit-equal."""
    quick = {"CKPT_SIDECAR_PART_TIMEOUT_S": "2", "CKPT_SIDECAR_LOG": "info,ckpt_sidecar::commit::nodes=debug"}
    cluster.start("a", env=quick)
    cluster.start("b", env=quick)
    saved, logs = cluster.ranks("save", "1")
    assert [s["held"] for s in saved] == [[1], [1]], logs
    cluster.wait_log("b", "markers go to this coordinator")
    cluster.nodes["a"].kill()
    procs, work = cluster.start_ranks("try-durable", "2", ranks=(1,))
    (out,) = [p.communicate(timeout=120)[0] for p in procs]
    assert procs[0].returncode == 0, out + cluster.logs()
    got = json.loads((work / "result-1.json").read_text())
    (failed,) = got["failed"]
    assert failed["step"] == 2 and "no commit nor abort by the coordinator" in failed["error"], got
    cluster.start("a", env=quick)
    saved, logs = cluster.ranks("save", "2")
    assert [s["held"] for s in saved] == [[2], [2]], logs
    durable = [ln for ln in cluster.nodes["a"].log.read_text().splitlines() if "this sidecar coordinated" in ln]
    assert "step=2" in durable[-1], durable
    loaded, logs = cluster.ranks("load")
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(2, True, None)] * 2, logs


def test_a_missing_replica_falls_back_to_the_drain_target_naming_the_peer_it_skipped(cluster, tmp_path):
    """Order: this node's disks, the peers, then the drain target. Both
    nodes drain to file://R too; then both sidecars are replaced (b on an
    emptied disk, a restarted: the replica of b's files it held in RAM is
    gone), and b's ranks' load reads b's files from the drain target,
    saying which peer it asked first."""
    remote = tmp_path / "remote"
    remote.mkdir()
    drain = ["--drain", f"file://{remote}"]
    for n in ("a", "b"):
        cluster.start(n, drain)
    saved, logs = cluster.ranks("replicate", "1")
    assert [s["held"] for s in saved] == [[1], [1]], logs
    for n in ("a", "b"):
        cluster.nodes[n].kill()
    shutil.rmtree(tmp_path / "L_b")
    (tmp_path / "L_b").mkdir()
    for n in ("a", "b"):
        cluster.start(n, drain)
    loaded, logs = cluster.ranks("load")
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(1, True, None)] * 2, logs
    skipped = loaded[1]["fell_back"] or ""
    assert f"from peer 127.0.0.1:{cluster.ports['a']}" in skipped and "not held" in skipped, (loaded[1], logs)
    # ... and the Checkpointer keeps saying so after the load (a load of
    # several ranks' parts asks the sidecar twice; the second ask must not
    # forget what the first passed over).
    kept = loaded[1]["last_load_fell_back"] or ""
    assert f"from peer 127.0.0.1:{cluster.ports['a']}" in kept, (loaded[1], logs)


def test_a_peer_that_cannot_be_reached_fails_the_replication_saying_why_and_the_save_stays_durable(cluster):
    """b's only peer is a closed port: b's steps are durable, and wait_peers
    raises IOFailed naming the peer (a's steps are held by b as usual)."""
    dead = free_port()
    cluster.start("a")
    cluster.start("b", peers=f"127.0.0.1:{dead}")
    saved, logs = cluster.ranks("try-save", "1")
    assert saved[0]["held"] == [1], logs
    [failed] = saved[1]["held"]
    assert failed["step"] == 1 and failed["error"].startswith("IOFailed") and f"127.0.0.1:{dead}" in failed["error"]
    assert cluster.nodes["b"].status()["peers"]["last_failed"] == 1


def test_peer_bandwidth_paces_the_replication_and_the_step_is_still_held(cluster):
    """a sends at most 2 MB/s (--peer-bandwidth): its ~4 MB of step 1 reach b
    no faster than that allows (the bucket starts with at most a quarter
    second's bytes), and the step is held as usual."""
    rate = 2_000_000
    cluster.start("a", extra=("--peer-bandwidth", "2MB/s"))
    cluster.start("b")
    saved, logs = cluster.ranks("save", "1", env_extra={"PEER_RANKS_KIB": "8192"})
    assert [s["held"] for s in saved] == [[1], [1]], logs
    a = cluster.nodes["a"].status()["peers"]
    assert a["last_held"] == 1 and a["last_held_by"] == ["b"], a
    [line] = [ln for ln in cluster.nodes["a"].log.read_text().splitlines() if "files are held by its peers" in ln]
    sent = int(re.search(r"bytes=(\d+)", line).group(1))
    assert sent > 4_000_000, line
    assert 0 < a["bytes_per_s"] <= rate * sent / (sent - rate / 4), (a, line)
    assert cluster.said("a", "peers: listening", "bandwidth_bytes_per_s=Some(2000000)"), cluster.logs()


def test_replicas_over_the_budget_spill_to_disk_and_a_replaced_node_loads_from_there(cluster, tmp_path):
    """a lends 1 MiB of memory (--peer-budget) and a spill folder
    (--peer-spill): b's ~2 MB steps do not fit, so a receives them into
    files there, checked as they come, and keeps the newest two as it would
    in memory. b's sidecar is then killed and its disk emptied: both ranks
    load step 3 bit-equal, b's files read from a's spill."""
    spill = tmp_path / "spill_a"
    cluster.start("a", extra=("--peer-budget", "1MiB", "--peer-spill", str(spill)))
    cluster.start("b")
    env = {"PEER_RANKS_KIB": "4096"}
    saved, logs = cluster.ranks("save", "1,2,3", env_extra=env)
    assert [s["held"] for s in saved] == [[1, 2, 3], [1, 2, 3]], logs
    p = cluster.nodes["a"].status()["peers"]
    assert sorted(map(tuple, p["holding"])) == [("b", 2), ("b", 3)] and p["holding_bytes"] == 0, p
    # One folder per replica held; step 1's went with it.
    folders = sorted((spill / "ckpt-peer-spill").iterdir())
    assert len(folders) == 2 and all(list(f.glob("*.safetensors")) for f in folders), folders
    assert cluster.said("a", "holding a replica", "step=3", "spilled=Some"), cluster.logs()
    cluster.nodes["b"].kill()
    shutil.rmtree(tmp_path / "L_b")
    (tmp_path / "L_b").mkdir()
    cluster.start("b")
    loaded, logs = cluster.ranks("load", env_extra=env)
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(3, True, None)] * 2, logs
    assert "loading from the peers" in cluster.nodes["b"].log.read_text()


def test_a_failure_domain_sends_a_nodes_steps_to_a_peer_outside_it_first(cluster):
    """Nodes a and b in rack r1, c in r2 (--failure-domain), each a peer of
    the other two, rank r on the r-th node. In ring order a's steps would go
    to b: they go to c, outside a's rack; b's to c; c's to a. Then a and b
    alone in r1: each one's steps still go to the other, said in the log."""
    cluster.ports["c"] = free_port()

    def others(me):
        return ",".join(f"127.0.0.1:{cluster.ports[n]}" for n in "abc" if n != me)

    for n, rack in (("a", "r1"), ("b", "r1"), ("c", "r2")):
        cluster.start(n, peers=others(n), extra=("--failure-domain", rack))
    saved, logs = cluster.finish(*cluster.start_ranks("save", "1", ranks=(0, 1, 2), world=3, on="abc"), world=3)
    assert [s["held"] for s in saved] == [[1], [1], [1]], logs
    held_by = {n: cluster.nodes[n].status()["peers"]["last_held_by"] for n in "abc"}
    assert held_by == {"a": ["c"], "b": ["c"], "c": ["a"]}, (held_by, cluster.logs())
    assert cluster.said("a", "peers: listening", "failure_domain=r1"), cluster.logs()
    assert not cluster.said("a", "held only within its own failure domain"), cluster.logs()
    cluster.stop()
    # c gone: a's and b's steps are held in their own rack, and each says so.
    for n in "ab":
        cluster.start(n, peers=f"127.0.0.1:{cluster.ports['b' if n == 'a' else 'a']}", extra=("--failure-domain", "r1"))
    saved, logs = cluster.ranks("save", "2")
    assert [s["held"] for s in saved] == [[2], [2]], logs
    for n, other in (("a", "b"), ("b", "a")):
        assert cluster.nodes[n].status()["peers"]["last_held_by"] == [other]
        assert cluster.said(n, "held only within its own failure domain", "step=2"), cluster.logs()


class Listener:
    """A port of its own whose accepted connections go to `take(conn)`, on a thread."""

    def __init__(self):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.take(c)


class Holder(Listener):
    """A port that accepts TCP connections and says nothing until `release()`,
    then closes them all, and every later one at once: a peer that stalls."""

    def __init__(self):
        self.held, self.released, self.lock = [], False, threading.Lock()
        self.accepted = threading.Event()
        super().__init__()

    def take(self, c):
        with self.lock:
            if self.released:
                c.close()
                return
            self.held.append(c)
        self.accepted.set()

    def release(self):
        with self.lock:
            self.released = True
            for c in self.held:
                c.close()

    def close(self):
        self.release()
        self.srv.close()


@pytest.mark.parametrize("keep", [1, 2])
def test_steps_the_peers_would_not_keep_are_skipped_when_the_replication_is_behind_and_said(cluster, keep):
    """b's only peer stalls: step 1's replication hangs on it (the ranks save
    steps 2 and 3 only once it reached the peer) while steps 2 and 3 become
    durable, then the peer lets go. With --peer-keep 1, b's peers would keep
    step 3 alone: b skips 2 (wait_peers(2) raises NotFound naming step 3,
    status counts it) and sends 3. With --peer-keep 2 (the default) both are
    sent in turn. Every step sent fails against the stalled peer, naming it."""
    holder = Holder()
    try:
        cluster.start("a")
        cluster.start("b", peers=f"127.0.0.1:{holder.port}", extra=("--peer-keep", str(keep)))
        procs, work = cluster.start_ranks("durable-then-peers", "1,2,3")
        assert holder.accepted.wait(120), "b's replication of step 1 never reached its peer" + cluster.logs()
        (work / "go").touch()
        wait_until(lambda: (work / "durable-3-r1").exists() or any(p.poll() is not None for p in procs), 120,
                   lambda: "step 3 never durable on b" + cluster.logs())
        holder.release()
        saved, logs = cluster.finish(procs, work)
    finally:
        holder.close()
    # a's steps go to b, which may fall behind too (a loaded machine): each
    # is held or skipped for newer ones, and the newest is held.
    a_held = saved[0]["held"]
    assert a_held[-1] == 3 and all(h in (1, 2) or "skipped" in h["error"] for h in a_held[:-1]), (a_held, logs)
    got = {h["step"]: h["error"] for h in saved[1]["held"]}
    assert sorted(got) == [1, 2, 3], (saved[1], logs)
    sent = (1, 3) if keep == 1 else (1, 2, 3)
    for s in sent:
        assert got[s].startswith("IOFailed") and f"127.0.0.1:{holder.port}" in got[s], (got, logs)
    peers = cluster.nodes["b"].status()["peers"]
    assert peers["last_failed"] == 3 and peers["shared_over_peers"] is False, peers
    if keep == 1:
        assert got[2].startswith("NotFound") and "skipped" in got[2] and "up to step 3" in got[2], (got, logs)
        assert peers["skipped_count"] == 1 and peers["last_skipped"] == 2, peers
        assert cluster.said("b", "replication behind", "skipped=[2]"), logs
    else:
        assert peers["skipped_count"] == 0 and peers["last_skipped"] is None, peers
        assert not cluster.said("b", "replication behind"), logs


class Recorder(Listener):
    """A TCP relay from a port of its own to `to_port`, keeping the first
    4 KiB the connecting side sent on its first connection."""

    def __init__(self, to_port):
        self.to_port, self.first = to_port, b""
        super().__init__()

    def take(self, c):
        up = socket.create_connection(("127.0.0.1", self.to_port))
        record = not self.first
        threading.Thread(target=self.pipe, args=(c, up, record), daemon=True).start()
        threading.Thread(target=self.pipe, args=(up, c, False), daemon=True).start()

    def pipe(self, src, dst, record):
        try:
            while chunk := src.recv(1 << 20):
                if record and len(self.first) < 4096:
                    self.first = (self.first + chunk)[:4096]
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def frames(data):
    """The peer frames in `data` (bodies), as far as they are whole."""
    out = []
    while len(data) >= 4 and len(data) >= 4 + int.from_bytes(data[:4], "little"):
        n = int.from_bytes(data[:4], "little")
        out.append(data[4:4 + n])
        data = data[4 + n:]
    return out


def answers(port, payload):
    """What a's peer port sends back to `payload` (then our end shut), as frame bodies."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        try:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            while chunk := c.recv(65536):
                data += chunk
        except OSError:
            pass  # a reset: a dropped the connection (what it sent first is kept)
    return frames(data)


WELCOME, REFUSED = 3, 4  # PeerMsg variants (wire/src/peer.rs; pinned by its golden file)


def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


# The peer protocol's version (wire/src/peer.rs PEER_PROTOCOL_VERSION).
PEER_PROTOCOL_VERSION = 4


def handshake_with(port, secret, node="x"):
    """A connector's handshake written out here (postcard by hand, HMAC from
    Python's hashlib), with `secret`: the kind of a's last answer."""
    nonce = os.urandom(32)
    hello = b"\0" + b"CKPP" + varint(PEER_PROTOCOL_VERSION) + varint(len(node)) + node.encode() + nonce
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(len(hello).to_bytes(4, "little") + hello)
        data = b""
        while not frames(data):
            chunk = c.recv(4096)
            assert chunk, "a closed before its Challenge"
            data += chunk
        body = frames(data)[0]
        assert body[0] == 1, body  # Challenge: variant, version, node, nonce, proof
        n = body[2]
        theirs_node, theirs = body[3:3 + n].decode(), body[3 + n:3 + n + 32]
        parts = [b"ckpt-peer-v1 connector", nonce, theirs, node.encode(), theirs_node.encode()]
        mac = hmac.new(secret, b"".join(len(p).to_bytes(8, "little") + p for p in parts), hashlib.sha256).digest()
        proof = b"\x02" + mac
        c.sendall(len(proof).to_bytes(4, "little") + proof)
        c.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := c.recv(4096):
            data += chunk
    return frames(data)[-1][0]


def test_garbage_a_replayed_handshake_and_another_secret_are_refused_and_saves_still_reach_their_peers(
        cluster, tmp_path):
    # b reaches a through a relay that keeps the first 4 KiB b sent a (its Hello, Proof, Offer).
    relay = Recorder(cluster.ports["a"])
    cluster.start("a")
    b_args = ["--shared", str(cluster.shared), "--node-local", "--node-id", "b",
              "--peer-listen", f"127.0.0.1:{cluster.ports['b']}", "--peers", f"127.0.0.1:{relay.port}",
              "--peer-secret-file", str(cluster.secret)]
    cluster.nodes["b"] = Sidecar(tmp_path, args=b_args, name="b", ckdir=tmp_path / "L_b").start()
    saved, logs = cluster.ranks("save", "1")
    assert [s["held"] for s in saved] == [[1], [1]], logs
    assert len(relay.first) == 4096, len(relay.first)
    a_port = cluster.ports["a"]
    # Random bytes: dropped (nothing comes back but, at most, a Refused).
    assert all(f[0] == REFUSED for f in answers(a_port, os.urandom(4096)))
    # The real peer's first 4 KiB again: a's fresh nonce makes its proof wrong.
    got = answers(a_port, relay.first)
    assert [f[0] for f in got] == [1, REFUSED], got
    # The handshake written out here: welcomed with the cluster's secret, refused with another.
    assert handshake_with(a_port, cluster.secret.read_bytes()) == WELCOME
    assert handshake_with(a_port, os.urandom(32)) == REFUSED
    assert cluster.nodes["a"].status()["peers"]["refused_connections"] >= 3
    assert "handshake failed" in cluster.nodes["a"].log.read_text()
    # A following save on both nodes still reaches wait_peers.
    saved, logs = cluster.ranks("save", "2")
    assert [s["held"] for s in saved] == [[2], [2]], logs


def test_a_sidecar_refuses_to_start_with_a_short_or_readable_secret(tmp_path):
    from sidecar_fixtures import sidecar_bin

    for data, mode, why in ((b"x" * 31, 0o600, "at least 32"), (os.urandom(32), 0o644, "chmod 600")):
        k = tmp_path / "K"
        k.write_bytes(data)
        k.chmod(mode)
        (tmp_path / "shared").mkdir(exist_ok=True)
        r = subprocess.run([sidecar_bin(), "serve", "--dir", str(tmp_path / "L"), "--socket", str(tmp_path / "s.sock"),
                            "--shared", str(tmp_path / "shared"), "--node-local", "--node-id", "a",
                            "--peer-listen", f"127.0.0.1:{free_port()}", "--peers", "127.0.0.1:1",
                            "--peer-secret-file", str(k)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and why in r.stderr, r.stderr
