"""One sidecar, many client processes: a process that leaks Checkpointers
gets its share of the sessions and no more, so the others still save, load
and ask `status` (docs/protocol.md, Session). (A session whose process is
gone while a child keeps its socket is closed too: the Rust test
tenants::the_sessions_of_a_process_gone_are_closed_though_a_child_keeps_their_sockets;
libckpt itself drops its connection in a forked child.)"""

import subprocess
import sys
import textwrap

import numpy as np

import ckpt_sidecar as cs

# Opens 300 Checkpointers (the refused ones' errors ignored), says how many
# it holds, then idles until its stdin closes.
HOG = textwrap.dedent(
    """
    import sys
    import ckpt_sidecar as cs
    held, refused = [], None
    for _ in range(300):
        try:
            held.append(cs.Checkpointer(socket=sys.argv[1], spawn=False))
        except cs.SidecarError as e:
            refused = str(e)
    print(len(held), refused, flush=True)
    sys.stdin.read()
    """
)


def test_a_process_leaking_300_checkpointers_locks_no_one_out(sidecar):
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, sidecar.socket],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held, refused = hog.stdout.readline().rstrip("\n").split(" ", 1)
        assert 0 < int(held) < 300, (held, refused)
        assert f"pid {hog.pid} holds {held}" in refused, refused
        # Another process saves and loads...
        with cs.Checkpointer(socket=sidecar.socket, spawn=False) as ck:
            w = np.arange(4096, dtype=np.float32)
            ck.save(1, {"w": w}).wait_durable(60)
            assert np.array_equal(ck.load(1)["w"], w)
        # ...and `status` answers, listing the hog's sessions.
        st = sidecar.status()
        assert sum(s["pid"] == hog.pid for s in st["sessions"]) == int(held)
    finally:
        hog.stdin.close()
        hog.wait(60)
