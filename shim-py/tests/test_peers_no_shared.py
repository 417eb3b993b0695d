"""Several nodes with no shared file system (docs/guide.md, "Several nodes
without a shared file system"): two sidecars on one machine as two nodes,
each with a folder of its own as --shared (`serve --shared S_x
--shared-over-peers --node-local --dir L_x --node-id x --peer-listen ...
--peers ...`), rank 0 on a, rank 1 on b. Nothing but the peer channel
connects them: each rank's marker and blobs reach the coordinator by
message, each committed step's index comes back to every node's own
folder, and a node replaced on an empty disk (both of its folders) takes
the newest step from its peer and loads bit-equal, with no drain target."""
import json
import shutil
import subprocess
import threading

import pytest
from sidecar_fixtures import sidecar_bin
from test_peers import Cluster, Listener, free_port, secret_file

INDEX = "model.safetensors.index.json"


class NoShared(Cluster):
    """Nodes a and b, each with its own S_x and L_x."""

    def shared_of(self, node):
        return self.tmp / f"S_{node}"

    def start(self, node, extra=(), peers=None, env=None):
        self.shared_of(node).mkdir(exist_ok=True)
        self.shared = self.shared_of(node)  # what Cluster.start passes as --shared
        return super().start(node, extra=("--shared-over-peers", *extra), peers=peers, env=env)

    def dir_of(self, node):
        # Each rank names its own node's folder (the client sends it as its checkpoint directory).
        return self.shared_of(node)

    def step_files(self, node, step):
        d = self.shared_of(node) / f"step-{step:012d}"
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


@pytest.fixture
def nodes(tmp_path):
    c = NoShared(tmp_path, secret_file(tmp_path / "K"))
    yield c
    c.stop()


def test_each_node_holds_every_step_and_a_replaced_node_takes_the_newest_from_its_peer(nodes, tmp_path):
    for n in ("a", "b"):
        nodes.start(n)
    saved, logs = nodes.ranks("save", "1,2")
    assert [s["held"] for s in saved] == [[1, 2], [1, 2]], logs
    for step in (1, 2):
        a, b = nodes.step_files("a", step), nodes.step_files("b", step)
        assert INDEX in a and a[INDEX] == b[INDEX], logs
        # Every blob the index lists is in both folders, the same bytes.
        blobs = [x["name"] for x in json.loads(a[INDEX])["ckpt"]["blobs"]]
        assert blobs and all(a[f"blobs/{n}"] == b[f"blobs/{n}"] for n in blobs), (blobs, sorted(a), sorted(b))
    for n in ("a", "b"):
        assert (nodes.shared_of(n) / "latest").read_text().strip().endswith("2"), n
        # Each node's shards are on its own disk only.
        assert list((tmp_path / f"L_{n}" / "node-step-000000000002").glob("*.safetensors"))
    assert "installed (committed by the coordinator; no shared file system)" in nodes.nodes["b"].log.read_text()
    # status says so.
    assert nodes.nodes["a"].status()["peers"]["shared_over_peers"] is True
    human = subprocess.run([sidecar_bin(), "status", "--socket", nodes.nodes["b"].socket], capture_output=True,
                           text=True, check=True).stdout
    assert f"shared:   {nodes.shared_of('b')} (several nodes, no shared file system" in human, human
    # b replaced on an empty machine: both its folders gone.
    nodes.nodes["b"].kill()
    for d in (tmp_path / "L_b", nodes.shared_of("b")):
        shutil.rmtree(d)
        d.mkdir()
    nodes.start("b")
    # Both steps a keeps are taken, the newest first.
    taken = [ln for ln in nodes.nodes["b"].log.read_text().splitlines() if "newer than this node's latest taken" in ln]
    assert [("step=2" in ln, "step=1" in ln) for ln in taken] == [(True, False), (False, True)], nodes.logs()
    for step in (1, 2):
        assert nodes.step_files("b", step)[INDEX] == nodes.step_files("a", step)[INDEX]
    assert (nodes.shared_of("b") / "latest").read_text().strip().endswith("2")
    loaded, logs = nodes.ranks("load")
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(2, True, None)] * 2, logs
    assert "loading from the peers" in nodes.nodes["b"].log.read_text()
    # Training goes on from there: step 3 commits on both nodes.
    saved, logs = nodes.ranks("save", "3")
    assert [s["held"] for s in saved] == [[3], [3]], logs
    assert nodes.step_files("b", 3)[INDEX] == nodes.step_files("a", 3)[INDEX]


def test_an_aborted_step_fails_the_other_nodes_rank_with_the_coordinators_reason(nodes):
    """World size 3, rank 2 never saves: the coordinator (a) aborts after the
    part timeout, and b's rank 1 hears a's reason, naming the missing rank,
    by message (there is no shared directory to leave it in). Ordered by
    events, not times: rank 0 starts once b's rank 1 part is written, and
    b's own wait (twice its part timeout) is far longer than a's."""
    nodes.start("a", env={"CKPT_SIDECAR_PART_TIMEOUT_S": "2"})
    nodes.start("b", env={"CKPT_SIDECAR_PART_TIMEOUT_S": "120"})
    first, work = nodes.start_ranks("try-durable", "1", world=3, ranks=(1,))
    nodes.wait_log("b", "rank's part written and marked", first, step=1)
    second, _ = nodes.start_ranks("try-durable", "1", world=3, ranks=(0,), fresh=False)
    procs = second + first
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs) + nodes.logs()
    for r in (0, 1):
        got = json.loads((work / f"result-{r}.json").read_text())
        (failed,) = got["failed"]
        assert failed["step"] == 1 and "rank(s) [2] of 3 wrote no marker" in failed["error"], (r, got, nodes.logs())
    assert not (nodes.shared_of("b") / "step-000000000001").exists()


def test_parts_reach_a_coordinator_that_restarts_or_moves_to_another_node(nodes):
    """a coordinated step 1. a's sidecar is killed and rank 1 saves step 2:
    its part cannot be sent, and is sent again until a new sidecar for a
    (same port) takes it; rank 0 then saves step 2 there and it commits.
    Step 3 with rank 0 on b and rank 1 on a: a knows no coordinator but
    itself, so it holds its part until b says it coordinates step 3, and
    sends it there; both load step 3."""
    nodes.start("a")
    nodes.start("b")
    saved, logs = nodes.ranks("save", "1")
    assert [s["held"] for s in saved] == [[1], [1]], logs
    nodes.wait_log("b", "markers go to this coordinator")
    nodes.nodes["a"].kill()
    first, work = nodes.start_ranks("save", "2", ranks=(1,))
    nodes.wait_log("b", "rank's part written and marked", first)
    nodes.start("a")
    second, _ = nodes.start_ranks("save", "2", ranks=(0,), fresh=False)
    saved, logs = nodes.finish(second + first, work)
    assert [s["held"] for s in saved] == [[2], [2]], logs
    procs, work = nodes.start_ranks("save", "3", on="ba")
    saved, logs = nodes.finish(procs, work)
    assert [s["held"] for s in saved] == [[3], [3]], logs
    durable = [ln for ln in nodes.nodes["b"].log.read_text().splitlines() if "this sidecar coordinated" in ln]
    assert len(durable) == 1 and "step=3" in durable[0], durable
    assert nodes.step_files("a", 3)[INDEX] == nodes.step_files("b", 3)[INDEX]
    procs, work = nodes.start_ranks("load", on="ba")
    loaded, logs = nodes.finish(procs, work)
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(3, True, None)] * 2, logs


def test_a_node_whose_committed_never_comes_asks_the_coordinator_before_giving_up(nodes):
    """Step 1 teaches b that a coordinates. a is then restarted with b's
    peer port wrong in its --peers: b's part of step 2 still reaches a
    (b knows where a is), a commits, but its Committed cannot reach b. Once
    b's ranks' wait runs out (twice the part timeout) b asks a for the
    step, installs it, and its rank is Durable, not failed. Ordered by
    events: rank 1 starts once a coordinates step 2, so a commits as b's
    part arrives, seconds before b's short wait (2 x 3 s) runs out; a's own
    part timeout is long."""
    patient, quick = {"CKPT_SIDECAR_PART_TIMEOUT_S": "120"}, {"CKPT_SIDECAR_PART_TIMEOUT_S": "3"}
    nodes.start("a", env=patient)
    nodes.start("b", env=quick)
    saved, logs = nodes.ranks("save", "1")
    assert [s["held"] for s in saved] == [[1], [1]], logs
    nodes.wait_log("b", "markers go to this coordinator")
    nodes.nodes["a"].kill()
    nodes.start("a", env=patient, peers=f"127.0.0.1:{free_port()}")
    first, work = nodes.start_ranks("try-durable", "2", ranks=(0,))
    nodes.wait_log("a", "coordinator of this step", first, step=2)
    second, _ = nodes.start_ranks("try-durable", "2", ranks=(1,), fresh=False)
    procs = first + second
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outs) + nodes.logs()
    got = [json.loads((work / f"result-{r}.json").read_text()) for r in (0, 1)]
    assert [g["durable"] for g in got] == [[2], [2]], (got, nodes.logs())
    assert "the step was asked of it and installed" in nodes.nodes["b"].log.read_text(), nodes.logs()
    assert nodes.step_files("b", 2)[INDEX] == nodes.step_files("a", 2)[INDEX]


def test_a_drain_commits_every_nodes_files_remotely_and_a_replaced_node_loads_from_it(nodes, tmp_path):
    """Both nodes drain to file://R: b's upload of each step reaches the
    coordinator (a) by message, and a commits the remote step once both
    nodes' files are up. Then a is restarted (the replica of b's files it
    held in memory is gone) and b replaced on empty disks: b takes the
    newest step from a, and its rank loads b's files from the drain target."""
    remote = tmp_path / "remote"
    remote.mkdir()
    drain = ["--drain", f"file://{remote}"]
    for n in ("a", "b"):
        nodes.start(n, drain)
    saved, logs = nodes.ranks("replicate", "1,2")
    assert [s["held"] for s in saved] == [[1, 2], [1, 2]], logs
    assert (remote / "step-000000000002" / INDEX).exists(), sorted(p.name for p in remote.iterdir())
    for n in ("a", "b"):
        nodes.nodes[n].kill()
    for d in (tmp_path / "L_b", nodes.shared_of("b")):
        shutil.rmtree(d)
        d.mkdir()
    for n in ("a", "b"):
        nodes.start(n, drain)
    loaded, logs = nodes.ranks("load")
    assert [(x.get("step"), x.get("equal"), x.get("error")) for x in loaded] == [(2, True, None)] * 2, logs
    skipped = loaded[1]["fell_back"] or ""
    assert f"from peer 127.0.0.1:{nodes.ports['a']}" in skipped and "not held" in skipped, (loaded[1], logs)


def test_a_sidecar_refuses_shared_over_peers_without_peers(tmp_path):
    r = subprocess.run([sidecar_bin(), "serve", "--dir", str(tmp_path / "L"), "--socket", str(tmp_path / "s.sock"),
                        "--shared", str(tmp_path), "--node-local", "--node-id", "a", "--shared-over-peers"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--peer-listen" in r.stderr, r.stderr


class Watcher(Listener):
    """A peer that never answers and notes, in a list it shares with others,
    when it accepted a connection and when the other end closed it."""

    def __init__(self, name, events, lock):
        self.name, self.events, self.lock, self.conns = name, events, lock, []
        super().__init__()

    def note(self, what):
        with self.lock:
            self.events.append((what, self.name))

    def take(self, c):
        self.note("accepted")
        self.conns.append(c)
        threading.Thread(target=self.watch, args=(c,), daemon=True).start()

    def watch(self, c):
        try:
            while c.recv(4096):
                pass
        except OSError:
            pass
        self.note("closed")

    def close(self):
        self.srv.close()
        for c in self.conns:
            c.close()


def test_a_starting_node_asks_its_peers_at_once_so_silent_ones_cost_one_timeout(nodes):
    """b starts on an empty machine with two peers that accept and never
    answer: it asks both at once (each ask gives up after its timeout), so
    both connections are open before either is given up; asked one after
    the other, the second would come only once the first was closed."""
    events, lock = [], threading.Lock()
    silent = [Watcher(n, events, lock) for n in ("p", "q")]
    try:
        nodes.start("b", peers=",".join(f"127.0.0.1:{w.port}" for w in silent))
        with lock:
            seen = list(events)
        assert any(e[0] == "closed" for e in seen), (seen, nodes.logs())
        first_closed = next(i for i, e in enumerate(seen) if e[0] == "closed")
        assert sorted(n for what, n in seen[:first_closed] if what == "accepted") == ["p", "q"], seen
        for w in silent:
            assert nodes.said("b", "not asked for its committed steps", f"127.0.0.1:{w.port}"), nodes.logs()
    finally:
        for w in silent:
            w.close()
