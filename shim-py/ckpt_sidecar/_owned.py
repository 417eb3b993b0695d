"""What a Checkpointer holds outside Python's heap, and its release.

`Owned` lists it (the native client, a spawned sidecar and its janitor, the
directory lock, the private folder, the saves the sidecar has not taken yet,
the share()'d tensors); `release` lets go of all of it, exactly once, every
step running even when an earlier one raised. It holds no reference to its
Checkpointer, so that a Checkpointer can be collected and still be closed
(weakref.finalize).
"""

import os
import shutil
import subprocess

from . import _native as N

# The janitor: a shell (a few hundred KiB, nothing else) spawned beside a
# spawned sidecar. Its stdin is a pipe whose write end only this process and
# the sidecar hold; EOF comes when both have let go of it, however they ended
# (close(), SIGKILL, a crash). It then removes the private folders (socket,
# log, the hook's checkpoint folder) and, if this process is gone, the
# shared-memory segments the C shim names after its pid (a process killed
# with SIGKILL cannot unlink them; the C shim only sweeps them at the next
# process's first allocation). A zombie counts as gone; a live process
# (close() was called) keeps its segments.
JANITOR_SH = r"""
while read -r _; do :; done
p=$1; shift
rm -rf -- "$@"
s=
if [ -r "/proc/$p/stat" ]; then read -r s < "/proc/$p/stat"; s=${s##*") "}; s=${s%% *}; fi
case "$s" in ""|Z|X) rm -f /dev/shm/ckpt-"$p"-* ;; esac
"""
JANITOR_WAIT_S = 5.0  # close() waits this long for it (forked children may still hold the pipe)


class Owned:
    """What a Checkpointer holds outside Python's heap: the native client, a
    spawned sidecar and its janitor, the directory lock, the private folder,
    the saves the sidecar has not taken yet, and the share()'d tensors.

    It holds no reference to its Checkpointer, so that one can be collected:
    `_release` runs exactly once, from close(), from a constructor that
    failed, or from the garbage collector (weakref.finalize) when the
    Checkpointer is gone without close()."""

    __slots__ = ("pid", "released", "client", "proc", "lock_fd", "tmpdir", "janitor", "life_w", "untaken", "shared")

    def __init__(self):
        self.pid = os.getpid()
        self.released = False
        self.client = self.proc = self.lock_fd = self.tmpdir = self.janitor = self.life_w = None
        self.untaken = set()  # ids of saves not yet taken by the sidecar (a close waits for them)
        self.shared = []  # restore callables of share()'d tensors


def release(own):
    """close() of everything in `own` (see Owned): pending saves taken,
    shared tensors back in private memory, the client closed, a spawned
    sidecar stopped (it commits what it took), the lock, the folder and the
    janitor released. Every step runs even if an earlier one raised; the
    first error is raised at the end. Once only: later calls do nothing.

    (Not weakref.finalize's __call__ for close(): once finalize's own exit
    handler has run, which can be before ours, it no longer calls anything.)"""
    if own.released:
        return
    own.released = True
    if os.getpid() != own.pid:
        # A forked child: the client, the sidecar and the lock are the parent's
        # (closing our copies of the pipes would not end the sidecar anyway).
        own.client = own.proc = own.janitor = own.tmpdir = own.lock_fd = own.life_w = None
        own.shared = []
        return
    errors = []

    def step(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - finish releasing first
            errors.append(e)

    client, own.client = own.client, None
    if client is not None:
        for sid in sorted(own.untaken):
            # Taken (or failed): the sidecar then commits it even without us.
            step(N.lib().ckpt_wait, client, sid, N.RELEASED, -1)
        own.untaken.clear()
    shared, own.shared = own.shared, []
    for restore in shared:  # while the regions are still mapped
        step(restore)
    if client is not None:
        step(N.lib().ckpt_close, client)
    proc, own.proc = own.proc, None
    if proc is not None:
        step(_stop_sidecar, proc)
    if own.lock_fd is not None:
        step(os.close, own.lock_fd)
        own.lock_fd = None
    if own.life_w is not None:
        step(os.close, own.life_w)  # the janitor's EOF once the sidecar is gone too
        own.life_w = None
    janitor, own.janitor = own.janitor, None
    if janitor is not None:
        try:
            janitor.wait(JANITOR_WAIT_S)
        except subprocess.TimeoutExpired:
            pass  # a forked child still holds the pipe: the janitor finishes after it
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    if own.tmpdir is not None:
        shutil.rmtree(own.tmpdir, ignore_errors=True)
        own.tmpdir = None
    if errors:
        raise errors[0]


def _stop_sidecar(proc):
    # EOF on its child's stdin: launch's child exits, launch commits what it
    # took and exits; wait for that.
    try:
        proc.stdin.close()
    finally:
        if proc.poll() is None:
            try:
                proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
