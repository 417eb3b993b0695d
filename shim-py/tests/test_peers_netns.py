"""Peers on two hosts of their own: each node's sidecar in a network
namespace, the two joined by a veth pair (real TCP between their own
addresses, as between two machines; docs/guide.md, "Peers"). The link is
rate-limited (tc tbf) so that a step's replication takes seconds, and cut
(`ip link set ... down`) once the step is durable, while its files are on
the wire: the replication fails within --peer-timeout on both nodes, saying
so, the step stays durable and loads bit-equal, and no replica of it is
held. With the link up again, the next step is held by the peer.

Needs root and iproute2 (`ip netns`, `tc`, `ss`); without them the test is
skipped, saying why."""
import os
import shutil
import subprocess

import pytest

from ckpt_test_util import wait_until
from sidecar_fixtures import Sidecar
from test_peers import Cluster, free_port, secret_file
from test_peers_no_shared import INDEX, NoShared


def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def netns_missing():
    """Why two namespaces with a veth pair cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root (ip netns needs it)"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"no {tool} (iproute2)"
    return None


class Hosts:
    """Namespaces a and b, a veth pair between them, addresses 10.233.N.1 and .2."""

    def __init__(self):
        tag = os.getpid() % 100000
        self.ns = {"a": f"ckpt-{tag}-a", "b": f"ckpt-{tag}-b"}
        self.dev = {"a": f"ck{tag}a", "b": f"ck{tag}b"}
        net = 10 + os.getpid() % 240
        self.addr = {"a": f"10.233.{net}.1", "b": f"10.233.{net}.2"}

    def make(self):
        steps = [
            ("ip", "netns", "add", self.ns["a"]),
            ("ip", "netns", "add", self.ns["b"]),
            ("ip", "link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"]),
        ]
        for n in ("a", "b"):
            steps += [
                ("ip", "link", "set", self.dev[n], "netns", self.ns[n]),
                ("ip", "-n", self.ns[n], "addr", "add", f"{self.addr[n]}/24", "dev", self.dev[n]),
                ("ip", "-n", self.ns[n], "link", "set", self.dev[n], "up"),
                ("ip", "-n", self.ns[n], "link", "set", "lo", "up"),
            ]
        for cmd in steps:
            r = run(*cmd)
            if r.returncode != 0:
                return f"{' '.join(cmd)}: {r.stderr.strip()}"
        return None

    def link(self, node, up):
        r = run("ip", "-n", self.ns[node], "link", "set", self.dev[node], "up" if up else "down")
        assert r.returncode == 0, r.stderr

    def connected(self, node, dst):
        """Whether `node` has an established TCP connection to `dst` (ADDR:PORT)."""
        r = run("ip", "netns", "exec", self.ns[node], "ss", "-Htn", "state", "established", "dst", dst)
        return r.returncode == 0 and r.stdout.strip() != ""

    def rate(self, rate):
        """Each side's egress limited to `rate` (tc tbf), or unlimited (None)."""
        for n in ("a", "b"):
            run("tc", "-n", self.ns[n], "qdisc", "del", "dev", self.dev[n], "root")
            if rate is not None:
                r = run("tc", "-n", self.ns[n], "qdisc", "add", "dev", self.dev[n], "root", "tbf", "rate", rate,
                        "burst", "32kbit", "latency", "400ms")
                assert r.returncode == 0, r.stderr

    def remove(self):
        for ns in self.ns.values():
            run("ip", "netns", "del", ns)


class NsSidecar(Sidecar):
    """A `serve` run inside a namespace (`ip netns exec NS`): its peer port
    is on that namespace's address; its Unix socket and directories are on
    the one file system, so the ranks reach it from here."""

    def __init__(self, ns, *a, **kw):
        super().__init__(*a, **kw)
        self.ns = ns

    def command(self):
        return ["ip", "netns", "exec", self.ns, *super().command()]


@pytest.fixture
def hosts():
    why = netns_missing()
    if why is None:
        h = Hosts()
        why = h.make()
        if why is not None:
            h.remove()
    if why is not None:
        print(f"skipped: {why}")
        pytest.skip(why)
    yield h
    h.remove()


class NsCluster(Cluster):
    """test_peers' two nodes, each sidecar in its namespace of `hosts`,
    listening for its peer on that namespace's address."""

    def __init__(self, tmp_path, secret, hosts):
        super().__init__(tmp_path, secret)
        self.hosts = hosts
        port = free_port()
        self.ports = {"a": port, "b": port}

    def start(self, node, extra=(), peers=None, env=None):
        other = "b" if node == "a" else "a"
        h = self.hosts
        args = ["--shared", str(self.shared), "--node-local", "--node-id", node,
                "--peer-listen", f"{h.addr[node]}:{self.ports[node]}", "--peers", f"{h.addr[other]}:{self.ports[other]}",
                "--peer-secret-file", str(self.secret), *extra]
        s = NsSidecar(h.ns[node], self.tmp, args=args, name=node, ckdir=self.tmp / f"L_{node}", env=env).start()
        self.nodes[node] = s
        return s


def test_a_link_cut_while_a_step_is_on_the_wire_fails_its_replication_in_time_and_the_next_step_is_held(
        hosts, tmp_path):
    cluster = NsCluster(tmp_path, secret_file(tmp_path / "K"), hosts)
    try:
        for n in ("a", "b"):
            cluster.start(n, ["--peer-timeout", "5s"])
        # 2 MiB per rank at 1 Mbit/s: ~16 s on the wire, so the cut below
        # (once both ranks are durable) finds it there.
        hosts.rate("1mbit")
        big = {"PEER_RANKS_KIB": "2048"}
        procs, work = cluster.start_ranks("try-save", "1", big)
        wait_until(lambda: all((work / f"durable-1-r{r}").exists() for r in (0, 1)), 120,
                   lambda: "step 1 durable on both ranks" + cluster.logs())
        # Each node's replication connected to the other: its files are on the wire.
        peer_of = {n: f"{hosts.addr[o]}:{cluster.ports[o]}" for n, o in (("a", "b"), ("b", "a"))}
        wait_until(lambda: all(hosts.connected(n, peer_of[n]) for n in ("a", "b")), 120,
                   lambda: "both replications connected" + cluster.logs())
        hosts.link("a", up=False)
        got, logs = cluster.finish(procs, work)
        for r in got:
            (held,) = r["held"]
            assert isinstance(held, dict) and held["step"] == 1, (r, logs)
            assert "not held by peers" in held["error"], (r, logs)
            assert "no progress within the peer timeout" in held["error"], (r, logs)
        hosts.link("a", up=True)
        hosts.rate(None)
        # The step is durable and loads, whole, on both nodes.
        got, logs = cluster.ranks("load", "1", big)
        for r in got:
            assert r.get("step") == 1 and r["equal"], (r, logs)
        # No replica of step 1 counts on either side; the next step is held.
        for n, other in (("a", "b"), ("b", "a")):
            assert [other, 1] not in cluster.nodes[n].status()["peers"]["holding"], cluster.logs()
        got, logs = cluster.ranks("save", "2")
        assert [r["held"] for r in got] == [[2], [2]], logs
        for n, other in (("a", "b"), ("b", "a")):
            assert [other, 2] in cluster.nodes[n].status()["peers"]["holding"], cluster.logs()
    finally:
        cluster.stop()


def saved_step_1_with_a_coordinator_known(cluster):
    """Both nodes started (a 5 s peer timeout), step 1 saved and held by
    peers, and b knowing a as the coordinator."""
    for n in ("a", "b"):
        cluster.start(n, ["--peer-timeout", "5s"])
    got, logs = cluster.ranks("save", "1")
    assert [r["held"] for r in got] == [[1], [1]], logs
    cluster.wait_log("b", "markers go to this coordinator")


def test_a_link_cut_mid_commit_loses_the_doorbells_and_the_shared_directory_stands_in(hosts, tmp_path):
    """Step 1 teaches b where the coordinator is; then the link is cut.
    Step 2's doorbells cannot pass (b's marker to a, a's Decided to b): a
    reads b's marker from the shared directory instead, commits, and b sees
    the commit there; the step is durable on both (its replication fails,
    saying so). With the link up, step 3 commits and is held as before."""
    cluster = NsCluster(tmp_path, secret_file(tmp_path / "K"), hosts)
    try:
        saved_step_1_with_a_coordinator_known(cluster)
        hosts.link("a", up=False)
        got, logs = cluster.ranks("try-save", "2")
        for r in got:
            (held,) = r["held"]
            assert isinstance(held, dict) and held["step"] == 2 and "not held by peers" in held["error"], (r, logs)
        durable = [ln for ln in cluster.nodes["a"].log.read_text().splitlines() if "this sidecar coordinated" in ln]
        # Only a's own marker came without a file read: b's was read from the shared directory.
        assert "step=2" in durable[-1] and "markers_sent=1" in durable[-1], durable
        hosts.link("a", up=True)
        got, logs = cluster.ranks("save", "3")
        assert [r["held"] for r in got] == [[3], [3]], logs
        got, logs = cluster.ranks("load", "1")
        assert [(r.get("step"), r.get("equal")) for r in got] == [(3, True)] * 2, logs
    finally:
        cluster.stop()


class NsNoShared(NoShared, NsCluster):
    """The two namespaces' nodes with no shared file system: each its own
    --shared folder and --shared-over-peers."""


def test_no_shared_file_system_a_link_cut_mid_commit_delays_the_step_and_it_commits_once_the_link_is_back(
        hosts, tmp_path):
    """No shared directory stands in for a lost message here: with the
    link cut, b's part of step 2 cannot reach the coordinator (a), which
    waits for it; b keeps sending it (its timeout is 5 s, the retries go
    on for 20 s). Once the link is back the part gets there, a commits,
    and its Committed reaches b: step 2 is durable on both ranks and in
    both nodes' folders."""
    cluster = NsNoShared(tmp_path, secret_file(tmp_path / "K"), hosts)
    try:
        saved_step_1_with_a_coordinator_known(cluster)
        hosts.link("a", up=False)
        procs, work = cluster.start_ranks("try-durable", "2")

        cluster.wait_log("a", "coordinator of this step", procs, step=2)
        cluster.wait_log("b", "rank's part written and marked", procs, step=2)
        assert not cluster.said("a", "durable", "step=2"), cluster.logs()
        hosts.link("a", up=True)
        got, logs = cluster.finish(procs, work)
        assert [r["durable"] for r in got] == [[2], [2]], (got, logs)
        assert cluster.step_files("a", 2)[INDEX] == cluster.step_files("b", 2)[INDEX]
        got, logs = cluster.ranks("load", "1")
        assert [(r.get("step"), r.get("equal")) for r in got] == [(2, True)] * 2, logs
    finally:
        cluster.stop()
