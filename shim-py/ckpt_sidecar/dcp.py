"""torch.distributed.checkpoint through the sidecar: `SidecarWriter` and
`SidecarReader`, a StorageWriter / StorageReader pair, so that `dcp.save`,
`dcp.async_save` and `dcp.load` keep DCP's planning and resharding
(FSDP, DTensor, replicated state deduplicated across ranks) while the
sidecar does the snapshot, the write and the one commit across ranks.

    import torch.distributed.checkpoint as dcp
    from ckpt_sidecar.dcp import SidecarWriter, SidecarReader
    dcp.save(state, storage_writer=SidecarWriter("ckpt"))          # every rank
    dcp.load(state, storage_reader=SidecarReader("ckpt"))          # any world size

How a save maps onto the sidecar: each rank's write items (tensors, or
chunks of sharded tensors, and pickled objects as U8 tensors) are that
rank's part of the step (SavePart, files rank-RRRRR-of-WWWWW-...); the
coordinator sends its own part last, from `finish`, with DCP's Metadata
(storage_data: item → tensor name) as the blob `dcp.metadata.pkl`, and
waits until the sidecar has committed every rank's part as one checkpoint.
Other ranks wait in `write_data` only until their part is copied
(released); DCP's closing collective makes `dcp.save` return on every rank
after the coordinator's `finish`, so after the commit.

CUDA tensors are never copied to the host by the trainer: `write_data`
hands them to the sidecar in place (their allocations registered, a save
fenced by an event on the stream they were written on), and the sidecar
copies them into its staging on its own stream, as `Checkpointer.save` does.

`dcp.async_save` uses the writer as its AsyncStager. `stage` copies every
host tensor once (other values deep-copied) and keeps CUDA tensors (torch's,
or `__cuda_array_interface__` objects) as they are: the sidecar's device
copy is their staging. DCP's background thread then runs the save above;
`synchronize_staging`, which async_save calls before it returns, waits on
the trainer's CPU only until this rank's part is sent (DCP's planning, a
message), then makes the trainer's stream (current at `stage`) wait until
the sidecar has copied the device tensors (`SaveHandle.wait_copy_on_stream`):
work queued on that stream after async_save returns (the optimizer step)
runs after the copy, and the CPU never waits for the copy itself. A state
with no CUDA tensor is staged by the host copy alone.

Shards are our safetensors shards. torch's HuggingFaceStorageReader reads
a step folder as plain safetensors: tensors whose one chunk is at the origin
come back under their fqn, but chunks elsewhere (`fqn@[...]`) and objects
(U8 tensors) come back as stored; SidecarReader puts everything back.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import pathlib
import pickle
import threading
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from . import _cuda
from ._tree import Flattener
from .checkpointer import Checkpointer
from .errors import InvalidArgument

METADATA_BLOB = "dcp.metadata.pkl"


def _item_name(index: MetadataIndex):
    """The stored tensor name of one write item: its fully qualified name, and
    for a chunk not at the origin, the chunk's offsets."""
    off = tuple(index.offset) if index.offset is not None else ()
    if any(off):
        return f"{index.fqn}@[{','.join(str(o) for o in off)}]"
    return index.fqn


def _stage_copy(obj, devices):
    """The staged copy of `obj` for async_save: host tensors cloned, other
    values deep-copied, and device memory (torch CUDA tensors, objects with
    `__cuda_array_interface__`) kept as it is, its torch devices added to
    `devices`: the sidecar's copy of it is its staging."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.is_cuda:
            devices.add(t.device)
            return t
        return t.clone() if t.device.type == "cpu" else t.cpu()
    if _cuda.interface(obj) is not None:
        devices.add(None)
        return obj
    if isinstance(obj, dict):
        return type(obj)((k, _stage_copy(v, devices)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_stage_copy(v, devices) for v in obj)
    return copy.deepcopy(obj)


class _DeviceStaging:
    """One async_save whose CUDA tensors the sidecar's copy stages: the
    trainer's stream of them (current at stage), and this rank's part's
    SaveHandle once DCP's background thread has sent it."""

    def __init__(self, torch_stream):
        self.torch_stream = torch_stream  # a handle, or None: no torch CUDA tensor (interface objects name theirs)
        self.stager = threading.current_thread()
        self.worker = None  # DCP's background thread, from its first call into the writer
        self.cv = threading.Condition()
        self.handle = None
        self.error = None  # why async_save cannot stage so (synchronize_staging raises it)
        self.over = False  # sent (handle set) or given up (the send failed)

    def seen_from(self, thread):
        if thread is not self.stager:
            with self.cv:
                self.worker = thread

    def sent(self, handle):
        with self.cv:
            self.handle, self.over = handle, True
            self.cv.notify_all()

    def refuse(self, err):
        with self.cv:
            self.error, self.over = err, True
            self.cv.notify_all()

    def wait_sent(self):
        """The part's SaveHandle once sent; None when DCP's background save
        ended without sending it (its failure is the upload future's)."""
        with self.cv:
            while not self.over:
                # Bounded waits only to notice a background thread that died
                # in DCP's planning, before any call that would notify.
                self.cv.wait(timeout=0.2)
                w = self.worker
                if w is not None and not w.is_alive():
                    break
            return self.handle


def _valid_id(checkpoint_id: Any) -> bool:
    """What DCP's FileSystemWriter/Reader accept as a checkpoint_id (their
    validate_checkpoint_id, which dcp.save/load ask to pick a storage when
    none is given): a pathlib.Path; else a string without a "://" scheme
    with an existing, writable ancestor folder."""
    if isinstance(checkpoint_id, pathlib.Path):
        return True
    if "://" in str(checkpoint_id):
        return False
    return any(p.exists() and os.access(str(p), os.W_OK) for p in pathlib.Path(checkpoint_id).parents)


def _new_dir(io: Any, checkpoint_id: Any) -> str:
    """The folder `checkpoint_id` names, for a reset of `io` (a SidecarWriter
    or SidecarReader): refused before anything is written when it is no
    local folder; a writer connected to another folder is closed first."""
    if not isinstance(checkpoint_id, (str, os.PathLike)) or "://" in str(checkpoint_id):
        raise InvalidArgument(
            f"checkpoint_id {checkpoint_id!r}: {type(io).__name__} takes a local folder (a str or a path)",
            InvalidArgument.code,
        )
    new = os.fspath(checkpoint_id)
    if os.path.realpath(new) != os.path.realpath(io.dir) and getattr(io, "_ck", None) is not None:
        io.close()
    return str(new)


def _check_holds(ck: Any, asked: str) -> None:
    """Refuses (closing `ck`) a Checkpointer whose sidecar holds another
    folder than the checkpoint_id `asked`: a sidecar found running at a
    given socket keeps its own folder, and nothing may go there instead."""
    if os.path.realpath(ck.dir) != os.path.realpath(asked):
        ck.close()
        raise InvalidArgument(
            f"checkpoint_id {asked!r}: the sidecar at {ck.socket or '(default socket)'} holds {ck.dir}, "
            "not this folder; give a checkpoint_id it holds, or no socket (a sidecar is then spawned for it)",
            InvalidArgument.code,
        )


def _done(value):
    f = torch.futures.Future()
    f.set_result(value)
    return f


class SidecarWriter(StorageWriter):
    """A StorageWriter that saves through the sidecar into `dir` as `step`
    (None: the step after the newest committed one). Extra keyword
    arguments go to the Checkpointer (socket, staging, ...)."""

    # AsyncStager (a runtime-checked Protocol: async_save uses the writer as
    # its stager only when it has every member, this property included;
    # else torch's DefaultStager copies every tensor to the CPU itself).
    # stage() returns when its copy is done; a stage of CUDA tensors (kept
    # in place) sets it on the instance, to have async_save call
    # synchronize_staging.
    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def __init__(self, dir: str | os.PathLike[str], step: int | None = None, **checkpointer_kwargs: Any) -> None:
        super().__init__()
        self.dir = str(dir)
        self.step = step
        self._kw = checkpointer_kwargs
        self._ck: Checkpointer | None = None
        self._own_part: Any = None  # (step, {name: tensor}) the coordinator sends from finish
        self._staging: _DeviceStaging | None = None  # of the async_save in flight
        self.is_coordinator = False
        self._id_given = False  # the folder came from a checkpoint_id: it must be the sidecar's

    def _checkpointer(self):
        if self._ck is None:
            ck = Checkpointer(dir=self.dir, **self._kw)
            if self._id_given:
                _check_holds(ck, self.dir)
            self._ck = ck
        return self._ck

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The state as async_save saves it (AsyncStager): host tensors
        copied, so the trainer may change them once this returns; CUDA
        tensors kept in place, staged by the sidecar's device copy (see
        synchronize_staging)."""
        devices: set[Any] = set()
        staged = _stage_copy(state_dict, devices)
        self._staging = None
        if devices:
            torch_devices = [d for d in devices if d is not None]
            stream = None
            if len(torch_devices) == 1:
                stream = torch.cuda.current_stream(torch_devices[0]).cuda_stream
            self._staging = _DeviceStaging(stream)
        self._synchronize_after_execute = self._staging is not None
        return staged

    def synchronize_staging(self) -> None:
        """After a stage of CUDA tensors (async_save calls this before it
        returns): waits until DCP's background thread has sent this rank's
        part, then makes the stream the tensors were written on wait until
        the sidecar has copied them, without the CPU waiting for the copy."""
        st = self._staging
        if st is None:
            return
        h = st.wait_sent()
        if self._staging is st:
            self._staging = None  # sent: a later dcp.save with this writer is fenced on its own thread's stream
        if st.error is not None:
            raise st.error
        if h is not None:
            h.wait_copy_on_stream()

    def __getstate__(self):
        # async_save's PROCESS executor pickles the writer to its daemon: the
        # part would be sent from there, and this process could not make the
        # trainer's stream wait on its copy (the tensors kept in place could
        # change before it). Refused, here and in synchronize_staging.
        st = self._staging
        if st is not None:
            err = InvalidArgument(
                "SidecarWriter stages CUDA tensors in place (the sidecar's device copy is the "
                "staging): use dcp.async_save's thread executor (AsyncCheckpointerType.THREAD, "
                "the default), not PROCESS",
                InvalidArgument.code,
            )
            st.refuse(err)
            raise err
        if self._ck is not None:
            raise TypeError("a SidecarWriter in use (its Checkpointer connected) cannot be pickled")
        return dict(self.__dict__)

    def close(self) -> None:
        if self._ck is not None:
            self._ck.close()
            self._ck = None

    def reset(self, checkpoint_id: Any = None) -> None:
        """DCP's start of a save: a `checkpoint_id` is the folder this save
        goes to. Another folder than the connected Checkpointer's: that one
        is closed (its saves finished first) and the next write connects to
        the sidecar holding the new folder, or spawns one for it."""
        if checkpoint_id is not None:
            self.dir = _new_dir(self, checkpoint_id)
            self._id_given = True
        self._own_part = None
        if self._staging is not None:
            self._staging.seen_from(threading.current_thread())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self._staging is not None:
            self._staging.seen_from(threading.current_thread())

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        # The coordinator picks the step once; every rank reads it from its plan.
        step = self.step
        if step is None:
            latest = self._checkpointer().latest()
            step = 0 if latest is None else latest + 1
        return [dataclasses.replace(p, storage_data=int(step)) for p in plans]

    def write_data(self, plan: Any, planner: Any) -> Any:
        step = plan.storage_data if plan.storage_data is not None else self.step
        named, results = {}, []
        for item in plan.items:
            data = planner.resolve_data(item)
            name = _item_name(item.index)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                t = np.frombuffer(raw, dtype=np.uint8).copy()
                n = t.nbytes
            elif (cai := _cuda.interface(data)) is not None:
                # Device memory by address (CuPy, Numba): the sidecar copies it in place.
                t = data
                n = int(np.prod(tuple(cai["shape"]), dtype=np.int64)) * np.dtype(cai["typestr"]).itemsize
            else:
                t = data.detach()
                # CUDA tensors go in place (the sidecar's device copy); other devices' through the host.
                if t.device.type != "cpu" and not t.is_cuda:
                    t = t.cpu()
                n = t.numel() * t.element_size()
            named[name] = t
            results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=name))
        if self.is_coordinator:
            # Sent from finish(), with the metadata: the part that completes the step.
            self._own_part = (step, named)
        else:
            h = self._send(step, named, [])
            h.wait_released()
        return _done(results)

    def _send(self, step, named, blobs):
        ck = self._checkpointer()
        fl = Flattener()
        fl.walk(named)
        for ref, _ in fl.leaves:
            assert ref.name in named, f"tensor name {ref.name!r} does not survive as a stored name"
        st = self._staging
        try:
            # From async_save's background thread: fenced on the trainer's stream, as of stage().
            h = ck._save_leaves(step, fl.leaves, blobs, 0.0, st.torch_stream if st is not None else None)
        except BaseException:
            if st is not None:
                st.sent(None)
            raise
        if st is not None:
            st.sent(h)
        return h

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md = {}
        for rank_results in results:
            for r in rank_results:
                storage_md[r.index] = r.storage_data
        metadata.storage_data = storage_md
        step, named = self._own_part
        self._own_part = None
        h = self._send(step, named, [(METADATA_BLOB, pickle.dumps(metadata, protocol=4))])
        h.wait_durable()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _valid_id(checkpoint_id)

    def storage_meta(self) -> None:
        return None


class SidecarReader(StorageReader):
    """A StorageReader of checkpoint `step` ("latest": the newest good one)
    of `dir`, loaded and verified by the sidecar (every byte checked against
    the index's checksums), whatever world size wrote it."""

    def __init__(self, dir: str | os.PathLike[str], step: int | str = "latest", **checkpointer_kwargs: Any) -> None:
        super().__init__()
        self.dir = str(dir)
        self.step = step
        self._kw = checkpointer_kwargs
        self._values: dict[str, Any] | None = None
        self._metadata: Any = None
        self._id_given = False  # as SidecarWriter's

    def reset(self, checkpoint_id: Any = None) -> None:
        """DCP's start of a load: a `checkpoint_id` is the folder read (each
        load connects afresh, so a new id is always honoured)."""
        if checkpoint_id is not None:
            self.dir = _new_dir(self, checkpoint_id)
            self._id_given = True
        self._values = None
        self._metadata = None

    def _load(self):
        if self._values is None:
            with Checkpointer(dir=self.dir, **self._kw) as ck:
                if self._id_given:
                    _check_holds(ck, self.dir)
                values = ck.load(self.step)
                blob = ck._loaded_blob(METADATA_BLOB)
                self.loaded_step = ck.last_load_step
            if blob is None:
                raise ValueError(
                    f"checkpoint {self.loaded_step} in {self.dir} was not written by SidecarWriter "
                    f"(no {METADATA_BLOB}); load it with Checkpointer.load"
                )
            self._values, self._metadata = values, pickle.loads(blob)
        return self._values

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._load()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = self._metadata or metadata

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        values = self._load()
        names = self._metadata.storage_data
        for req in plan.items:
            arr = values[names[req.storage_index]]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(np.ascontiguousarray(arr).tobytes()))
                continue
            target = planner.resolve_tensor(req).detach()
            src = torch.from_numpy(arr if arr.flags.c_contiguous else arr.copy())  # (ascontiguousarray makes 0-d 1-d)
            if src.dtype != target.dtype:
                # BF16 and F8 come back as raw uint16 / uint8: same bytes, other view.
                src = src.view(target.dtype)
            for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(dim, o, n)
            if target.size() != src.size():
                raise AssertionError(
                    f"{req.storage_index}: stored chunk {tuple(src.size())} vs target {tuple(target.size())}"
                )
            target.copy_(src)
            planner.commit_tensor(req, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _valid_id(checkpoint_id)
