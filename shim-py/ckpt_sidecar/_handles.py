"""What save() and load_into() hand back: `SaveHandle`, one save in flight
(released, taken, durable, replicated), and `LoadedInto`, the step a
load_into() restored and what it left out."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

from . import _native as N
from ._units import timeout_ms
from .errors import SidecarError, Timeout


class SaveHandle:
    """One save in flight.

    Two moments matter and can differ:
    - *released* (wait_released, released): the trainer may change its tensors
      again, and the checkpoint commits even if this process dies from then
      on. For a save whose tensors were all copied into shared memory by
      save() itself (no share()'d tensor), that is when save() returns: the
      copy is the snapshot, and its save region is handed over to the sidecar
      (docs/protocol.md, RegisterRegion `hand_over`), which finishes its own
      copy and commits even if this process is killed right after save().
      When some tensors were sent in place (share()), it is when the sidecar
      has copied them; such a save not yet taken is aborted when the process
      dies (those tensors may be changing).
    - *taken* (wait_taken, taken): the sidecar holds its own copy of every
      tensor (its Released reply); the save's region may then be reused.
    `stall_seconds`: time the trainer was blocked by this save (inside save()
    plus inside wait_released())."""

    def __init__(self, ck: Any, step: int | None, save_id: int, region: Any, stall_s: float, inplace: bool) -> None:
        self._ck, self.step, self.id, self._region = ck, step, save_id, region
        self.stall_seconds = stall_s
        self.copied_bytes = 0
        self.inplace = inplace
        self._taken = False
        self.cuda_stream = None  # the stream a device-only save was fenced on (wait_copy_on_stream)

    def _mark_taken(self):
        self._taken = True
        self._ck._own.untaken.discard(self.id)
        if self._region is not None:
            self._ck._give_back(self._region)
            self._region = None

    def state(self) -> str:
        """ "pending" (not taken), "released" (taken), "durable", "replicated" (once
        wait_replicated returned) or "failed", without blocking."""
        st = ctypes.c_int()
        N.check(N.lib().ckpt_poll(self._ck._live_client(), self.id, ctypes.byref(st)))
        if st.value != N.PENDING:
            self._mark_taken()
        return {
            N.PENDING: "pending",
            N.RELEASED: "released",
            N.DURABLE: "durable",
            N.FAILED: "failed",
            N.REPLICATED: "replicated",
        }[st.value]

    def wait_released(self, timeout: float | None = None) -> SaveHandle:
        """Block until the trainer may change the saved tensors again, and the
        checkpoint commits even if this process dies (see the class doc: at
        once for a save copied at save()); raises the save's failure if it
        is already known."""
        if not self.inplace or self._taken:
            if self.state() == "failed":
                self._wait(N.RELEASED, 0)
            return self
        t0 = time.perf_counter()
        try:
            self.wait_taken(timeout)
        finally:
            self.stall_seconds += time.perf_counter() - t0
        return self

    def wait_copy_on_stream(self, stream: int | None = None, timeout: float | None = None) -> bool:
        """Make CUDA `stream` (a handle; None: the stream this save was fenced
        on) wait until the sidecar has copied this save's device tensors,
        without the CPU waiting for the copy: work queued on it afterwards
        (the optimizer step) runs after the copy. The CPU waits only until
        the sidecar has queued the copy (a message away). A save with host
        tensors in place, or none on a device, is waited for on the CPU
        (wait_released). Returns True when a stream wait was queued."""
        if self.cuda_stream is None or self._taken:
            self.wait_released(timeout)
            return False
        on = ctypes.c_int()
        stream = self.cuda_stream if stream is None else int(stream)
        t0 = time.perf_counter()
        try:
            N.check(
                N.lib().ckpt_stream_wait_copy(
                    self._ck._live_client(), self.id, stream, timeout_ms(timeout), ctypes.byref(on)
                )
            )
        except Timeout:
            raise
        except SidecarError:
            self._mark_taken()
            raise
        finally:
            self.stall_seconds += time.perf_counter() - t0
        return bool(on.value)

    def wait_taken(self, timeout: float | None = None) -> SaveHandle:
        """Block until the sidecar holds its own copy (its Released reply)."""
        return self._wait(N.RELEASED, timeout)

    def wait_durable(self, timeout: float | None = None) -> SaveHandle:
        """Block until the checkpoint is committed on disk; raises its failure."""
        return self._wait(N.DURABLE, timeout)

    def wait_replicated(self, timeout: float | None = None) -> SaveHandle:
        """Block until the checkpoint is *replicated*: durable, then committed on
        the sidecar's drain target (`--drain URL`: its files, then its remote
        index). Raises Timeout when `timeout` (seconds) passes (the upload
        goes on), the save's failure, or NotFound at once, saying why, when
        the sidecar has no drain target or its drain skipped this step (a
        newer one was drained instead, or --drain-every leaves it out)."""
        return self._answered(lambda client: N.lib().ckpt_wait_replicated(client, self.id, timeout_ms(timeout)))

    def wait_peers(self, timeout: float | None = None) -> SaveHandle:
        """Block until this node's files of the checkpoint are *held by peers*:
        durable, then checked and held in the memory of `--peer-replicas`
        other nodes' sidecars (`--peers`). Raises Timeout when `timeout`
        (seconds) passes (the replication goes on), NotFound at once when the
        sidecar has no peers or when the step was skipped (more than
        `--peer-keep` newer steps were waiting to be sent: the peers would not
        keep it), or IoError saying which peer failed and why.
        Training never waits for peers unless it calls this."""
        return self._answered(lambda client: N.lib().ckpt_wait_peers(client, self.id, timeout_ms(timeout)))

    def _wait(self, what: int, timeout: float | None) -> SaveHandle:
        return self._answered(lambda client: N.lib().ckpt_wait(client, self.id, what, timeout_ms(timeout)))

    def _answered(self, wait: Callable[[Any], int]) -> SaveHandle:
        """Runs `wait(client)`, a native wait for this save. Any answer but a
        timeout (success or the save's failure) means the sidecar is done
        with our memory for this save."""
        try:
            N.check(wait(self._ck._live_client()))
        except Timeout:
            raise
        except SidecarError:
            self._mark_taken()
            raise
        self._mark_taken()
        return self

    def released(self) -> bool:
        """Whether the trainer may change the saved tensors (without blocking)."""
        return not self.inplace or self.taken()

    def taken(self) -> bool:
        return self._taken or self.state() != "pending"

    def done(self) -> bool:
        """True once the save is durable or failed (wait_durable returns or raises at once)."""
        return self.state() in ("durable", "replicated", "failed")

    def figures(self) -> dict[str, float | None]:
        """{"copy_s", "waited_s", "persist_s"} as the sidecar reported them (None: not yet known)."""
        vals = [ctypes.c_double() for _ in range(3)]
        N.check(N.lib().ckpt_save_figures(self._ck._live_client(), self.id, *(ctypes.byref(v) for v in vals)))
        return {k: (v.value if v.value >= 0 else None) for k, v in zip(("copy_s", "waited_s", "persist_s"), vals)}

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} id={self.id}>"


class LoadedInto(int):
    """What load_into() did: the step loaded (this int itself, also `step`),
    `source` ("ram", "disk" or "drain") and, named as torch's load_state_dict names
    them, `missing_keys` (tensors of the state the checkpoint lacks) and
    `unexpected_keys` (tensors of the checkpoint the state lacks); both are
    empty unless strict=False."""

    step: int
    source: str
    missing_keys: list[str]
    unexpected_keys: list[str]

    def __new__(cls, step: int, source: str, missing_keys: list[str], unexpected_keys: list[str]) -> LoadedInto:
        self = super().__new__(cls, step)
        self.step, self.source = step, source
        self.missing_keys, self.unexpected_keys = missing_keys, unexpected_keys
        return self

    def __repr__(self) -> str:
        return (
            f"LoadedInto(step={self.step}, source={self.source!r}, missing_keys={self.missing_keys}, "
            f"unexpected_keys={self.unexpected_keys})"
        )
