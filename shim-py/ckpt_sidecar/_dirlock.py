"""Who holds a checkpoint directory, as the store's lock file says
(store/src/lock.rs: `<dir>/.ckpt-sidecar.lock`, lines `pid=`, `role=` and a
daemon's `socket=`), so that a Checkpointer can reach a sidecar serving the
directory, or name it. The file outlives a killed holder (unlocked): what it
names is a claim to check (connect to the socket), never proof."""

import os

STORE_LOCK_NAME = ".ckpt-sidecar.lock"
HOLDER_BYTES_MAX = 4096


def holder(d):
    """{"pid": int or None, "role": str, "socket": str or None} that `d`'s
    store lock file names, or None when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(d, STORE_LOCK_NAME), "rb") as f:
            text = f.read(HOLDER_BYTES_MAX).decode("utf-8", "replace")
    except OSError:
        return None
    h = {"pid": None, "role": "", "socket": None}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        value = value.strip()
        if not eq:
            continue
        if key == "pid" and value.isdigit():
            h["pid"] = int(value) or None
        elif key == "role":
            h["role"] = value
        elif key == "socket" and value:
            h["socket"] = value
    return h if h["pid"] or h["socket"] else None


def describe(h):
    """`pid 123 (ckpt-sidecar serve, socket /run/x.sock)`, as the store says it."""
    who = f"pid {h['pid']}" if h["pid"] else "an unknown process"
    role = f"ckpt-sidecar {h['role']}" if h["role"] else ""
    if h["socket"]:
        return f"{who} ({role + ', ' if role else ''}socket {h['socket']})"
    return f"{who} ({role})" if role else who
