"""The connection to a sidecar: one already running (the socket, or the one
`ckpt-sidecar serve` runs for the directory), or one spawned for this
process (`ckpt-sidecar launch`, its directory lock, its private folder and
the janitor that removes that folder).

`SidecarConnection` is the base of the Checkpointer: it holds the client and
says when this process may speak on it (`_live_client`: never after close(),
never in a forked child), and restarts a spawned sidecar that exited
(`_ensure`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import subprocess
import tempfile
import time
import warnings
import weakref
from typing import Any

from . import _dirlock, dist
from . import _native as N
from ._owned import JANITOR_SH, Owned
from .errors import Closed, ConnectFailed, Disconnected, SidecarError

LOCK_NAME = ".ckpt-sidecar-py.lock"
SPAWN_TIMEOUT_S = 120.0  # the sidecar pre-faults its staging first (up to ~2 s per GiB)

live: weakref.WeakSet[Any] = weakref.WeakSet()  # the open Checkpointers of this process (closed at exit)


def _owned(name: str) -> Any:
    return property(lambda self: getattr(self._own, name), lambda self, v: setattr(self._own, name, v))


class SidecarConnection:
    """The client of a Checkpointer, and the sidecar it speaks to (see the module doc)."""

    # Set by the Checkpointer's constructor (declared here for the stages
    # built on this class: _regions, _save, _load, _load_into).
    dir: str
    socket: str | None
    rank: int
    world_size: int
    local_rank: int
    log_path: str
    last_load_step: int
    last_load_source: str
    last_load_fell_back: str | None
    _own: Owned
    _mu: Any  # threading.RLock: every call on the client holds it
    _finalizer: weakref.finalize
    _private_dir: bool
    _socket_arg: bool
    _keep: int | None
    _staging: int | None
    _log: str | None
    _cpus: str | None
    _log_from: int
    _trust: Any  # _trust.Tracker with incremental="trust-version", else None
    _last: Any  # the SaveHandle of the last save, or None
    _budget: int | None

    _client = _owned("client")
    _proc = _owned("proc")
    _tmpdir = _owned("tmpdir")
    _lock_fd = _owned("lock_fd")

    def _open(self, dir, spawn, spawn_options):
        """Connects to the sidecar at self.socket, else (with `spawn`) to the
        one `ckpt-sidecar serve` runs for self.dir, else spawns one. A sidecar
        found running keeps its own directory and options: a warning names
        the `spawn_options` ({name: value} given) that then do nothing."""
        try:
            self._client = self._connect(self.socket)
            joined = True
        except ConnectFailed as e:
            if not spawn:
                raise
            joined = not self._socket_arg and not self._private_dir and self._join_serving()
            if not joined:
                ranks = dist.rank_info()
                if ranks.world_size > 1 and not self._private_dir:
                    # A sidecar per rank cannot commit one checkpoint of all ranks.
                    raise ConnectFailed(
                        f"rank {ranks.rank} of {ranks.world_size}: no sidecar reachable ({e}), and none "
                        f"that `ckpt-sidecar serve` runs for {self.dir}; run the job as "
                        f"`ckpt-sidecar launch --dir DIR -- torchrun ...` (one sidecar per node), or start "
                        f"`ckpt-sidecar serve --dir {self.dir}` per node (ranks find it through the folder)",
                        ConnectFailed.code,
                    ) from e
                self._spawn()
        if joined:
            self._check_dir(dir)
            given = [f"{k}={v!r}" for k, v in spawn_options.items()]
            if given:
                # They are the options of a sidecar this Checkpointer starts.
                warnings.warn(
                    f"{', '.join(given)}: ignored, the sidecar at {self.socket or '(default socket)'} "
                    "was already running (they apply to one this Checkpointer spawns)"
                )

    def _join_serving(self):
        """Connects to the sidecar `ckpt-sidecar serve` runs for this
        directory, when its lock file names one that answers (a sidecar
        serves one directory: a second one could not take it); True if so."""
        h = _dirlock.holder(self.dir)
        if h is None or h["role"] != "serve" or not h["socket"]:
            return False
        try:
            self._client = self._connect(h["socket"])
        except (ConnectFailed, Disconnected):
            return False  # its holder is gone (the file outlives a killed one): spawn as usual
        self.socket = h["socket"]
        return True

    def _check_dir(self, asked):
        """A running sidecar writes where it was told: say so when that is not `dir`."""
        try:
            st = self.status()
        except SidecarError:
            return
        # Several nodes: the ranks' checkpoints are in the shared directory.
        dirs = [st["shared_dir"]] if st.get("shared_dir") else (st.get("dirs") or [])
        if dirs:
            if asked is not None and os.path.realpath(dirs[0]) != os.path.realpath(self.dir):
                warnings.warn(
                    f"the sidecar at {self.socket or '(default socket)'} writes to {dirs[0]}, "
                    f"not {self.dir}: checkpoints go there"
                )
            self.dir = dirs[0]

    # ---- connection and the spawned sidecar ----

    @staticmethod
    def _connect(path):
        out = ctypes.c_void_p()
        N.check(N.lib().ckpt_connect(path.encode() if path else None, ctypes.byref(out)))
        # A Python trainer never blocks on the sidecar's Released right after
        # save(): copied tensors are released at once, shared ones only at the
        # guarded optimizer step, after forward and backward. So the sidecar
        # may checksum while it copies (one pass over memory fewer).
        try:
            N.check(N.lib().ckpt_set_lazy_release(out, 1))
        except BaseException:
            N.lib().ckpt_close(out)
            raise
        return out

    def _spawn(self):
        if self._private_dir:
            self._make_tmpdir()
            self.dir = os.path.join(self._tmpdir, "ckpt")
        # Another open Checkpointer of this process holds the lock below: waiting
        # for it (as for a draining sidecar) would wait out the whole deadline.
        for other in list(live):
            if (
                other._proc is not None
                and other._client is not None
                and other._own.pid == os.getpid()
                and os.path.realpath(other.dir) == os.path.realpath(self.dir)
            ):
                raise SidecarError(
                    f"{self.dir} is in use by another Checkpointer of this process, which spawned "
                    "its sidecar; use that one, or close() it first"
                )
        os.makedirs(self.dir, exist_ok=True)
        # One sidecar per directory: the lock is inherited by the sidecar and held
        # until it exits, so a restarted trainer waits for a draining one. A
        # directory where no file can be made (read-only) gets no lock file
        # here: its sidecar serves loads only, without a lock (nothing writes).
        try:
            self._lock_fd = os.open(os.path.join(self.dir, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
        deadline = time.monotonic() + 120
        while self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                    h = _dirlock.holder(self.dir)
                    who = f": {_dirlock.describe(h)}" if h is not None else ""
                    raise SidecarError(f"{self.dir} is in use by another spawned sidecar{who} ({e})") from e
                time.sleep(0.05)
        if self._tmpdir is None:
            self._make_tmpdir()
        if not self._socket_arg:
            # Private: only this process (and its children, through ck.socket) use it.
            self.socket = os.path.join(self._tmpdir, "sidecar.sock")
        self._start_proc()

    def _make_tmpdir(self):
        """The private folder (socket, log), and the janitor that removes it
        once this process and the sidecar are both gone (see JANITOR_SH)."""
        own = self._own
        own.tmpdir = tempfile.mkdtemp(prefix="ckpt-sidecar-py-")
        r, w = os.pipe()  # both close-on-exec: only the janitor and the sidecar get an end
        try:
            own.janitor = subprocess.Popen(
                ["/bin/sh", "-c", JANITOR_SH, "ckpt-sidecar-janitor", str(os.getpid()), own.tmpdir],
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            os.close(w)
            warnings.warn(f"no janitor for {own.tmpdir} ({e}): if this process is killed, the folder stays behind")
        else:
            own.life_w = w
        finally:
            os.close(r)

    def _start_proc(self):
        # `launch` with a child that waits for EOF on a pipe this process holds:
        # when this process ends, however it ends (SIGKILL too), the pipe closes,
        # the child exits, and launch commits the saves it had taken (and those
        # handed over: copied at save() and sent), then exits
        # (freeing the directory lock). close() closes the pipe the same way.
        # (Not PR_SET_PDEATHSIG: with a multi-threaded parent it can fire once per
        # exiting thread, and a second SIGTERM makes the sidecar abort.)
        cmd = [N.sidecar_binary(), "launch", "--dir", self.dir, "--socket", self.socket]
        if self._keep is not None:
            cmd += ["--keep", str(int(self._keep))]
        if self._staging is not None:
            cmd += ["--staging", str(self._staging)]
        if self._cpus is not None:
            cmd += ["--cpus", self._cpus]
        # The child ignores SIGTERM/SIGINT/SIGHUP (ignored dispositions survive
        # exec): launch forwards those to it, so a signal sent to every process
        # of the job (a scheduler's preemption notice) leaves the sidecar
        # serving the trainer's last save; only the pipe's end stops it.
        cmd += ["--", "/bin/sh", "-c", 'trap "" TERM INT HUP; exec cat']
        self.log_path = self._log or os.path.join(self._tmpdir, "sidecar.log")
        # The sidecar holds the lock and the janitor's pipe until it exits.
        keep = tuple(fd for fd in (self._lock_fd, self._own.life_w) if fd is not None)
        with open(self.log_path, "ab") as logf:
            self._log_from = logf.tell()  # a log= file may hold earlier runs
            # Own session: a Ctrl-C at the terminal reaches the trainer, which then stops it in order.
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=logf, stderr=logf, pass_fds=keep, start_new_session=True
            )
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                raise SidecarError(f"spawned sidecar exited with {self._proc.returncode}: {self._log_tail()}")
            if os.path.exists(self.socket):
                try:
                    client = self._connect(self.socket)
                    break
                except (ConnectFailed, Disconnected):
                    pass
            if time.monotonic() > deadline:
                self._proc.kill()
                self._proc.wait()
                raise SidecarError(f"spawned sidecar did not listen within {SPAWN_TIMEOUT_S} s: {self._log_tail()}")
            time.sleep(0.02)
        if self._client is None:
            self._client = client
        else:
            # Respawned: the old client reconnects (regions keep their addresses).
            N.lib().ckpt_close(client)
            N.check(N.lib().ckpt_reconnect(self._client))

    def _log_tail(self):
        """Why the spawned sidecar stopped, in one line: its error line (the
        command line's `error: ...`), not the log lines before it; else the
        log's last line."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                lines = [ln.strip() for ln in f.read()[-8000:].decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        errors = [ln[len("error: ") :] for ln in lines if ln.startswith("error: ")]
        return errors[-1] if errors else (lines[-1] if lines else "(its log is empty)")

    def _live_client(self):
        """The client, when this process may speak on it: Closed after
        close(), and in a forked child (its handles' calls too)."""
        if self._client is None:
            raise Closed("the Checkpointer is closed", -16)
        if os.getpid() != self._own.pid:
            # A forked child shares the parent's connection and regions: it
            # must not speak on them, nor start a sidecar of its own.
            raise Closed(
                f"this Checkpointer belongs to process {self._own.pid}; a forked child "
                "cannot use it (make a new Checkpointer in the child)",
                -16,
            )
        return self._client

    def _ensure(self):
        self._live_client()
        if self._proc is not None and self._proc.poll() is not None:
            warnings.warn(f"the spawned sidecar exited ({self._proc.returncode}); starting a new one")
            self._proc.stdin.close()  # ends the old launch's child, if it outlived launch
            self._start_proc()

    @property
    def spawned(self) -> bool:
        """True when this Checkpointer started its own sidecar."""
        return self._proc is not None

    def status(self) -> dict[str, Any]:
        """The sidecar's status report (dict)."""

        L = N.lib()
        with self._mu:
            self._ensure()
            n = ctypes.c_size_t()
            N.check(L.ckpt_status_json(self._client, None, 0, ctypes.byref(n)))
            buf = ctypes.create_string_buffer(n.value + 1)
            N.check(L.ckpt_status_json(self._client, buf, n.value + 1, ctypes.byref(n)))
            return json.loads(buf.value.decode())
