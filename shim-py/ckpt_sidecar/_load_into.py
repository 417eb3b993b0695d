"""load_into(): a checkpoint restored into the tensors and arrays a state
already holds, in place (same objects, same memory), after the whole state
was matched against the checkpoint's index, and the checkpoint verified
before anything of the state is written. Tensors in this client's shared
memory and device tensors are written by the sidecar itself; the other host
tensors are copied from a load region through their strides.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from . import _alias, _cuda
from . import _native as N
from ._blob_names import PARTS_BLOB, STRUCTURE_BLOB
from ._handles import LoadedInto
from ._load import LOAD_TRIES_MAX, NOT_PLACED, ST_NAMES, Loading, collect_refs
from ._regions import align
from ._tree import SKELETON_VERSIONS_READ, Flattener, torch_module, unpickle_skeleton
from ._units import step_arg
from .errors import Damaged, InvalidArgument, SidecarError


class _Held:
    """What a load_into holds until it returns (freed then, also on error):
    the load region and the lease its views keep, the bounce region, and
    the bytes to copy into the state ({name: uint8 array or None})."""

    __slots__ = ("target", "lease", "bounce", "srcs")

    def __init__(self):
        self.target = self.lease = self.bounce = None
        self.srcs = {}


class LoadingInto(Loading):
    """load_into() of a Checkpointer (see the module doc)."""

    def load_into(self, state: Any, step: int | str = "latest", strict: bool = True) -> LoadedInto:
        """Restore checkpoint `step` ("latest": the newest good one) into the
        tensors and arrays `state` already holds, in place, and return the
        step loaded (a `LoadedInto`, an int that also says what was missing).

        `state` is what `save()` takes: dicts (nested), lists and tuples of
        torch CPU tensors, numpy arrays and CUDA tensors / objects with
        `__cuda_array_interface__`, each matched by the name `save()` gives it
        ("model.embed.weight"). Every tensor keeps its identity (same object,
        same memory: a model's parameters and an optimizer's state stay
        bound); non-contiguous ones are written through their strides. Other
        leaves (ints, strings, ...) are left alone.

        Nothing of `state` is written unless all of this holds; else
        `InvalidArgument` says in one line which tensor differs and how:
        every tensor of both has the same dtype and shape (and the same real
        dtype where the checkpoint's structure records one); with `strict`
        (default), the checkpoint holds exactly the tensors of `state`
        (`strict=False` loads the ones both have, as torch's
        `load_state_dict(strict=False)`; the result's `missing_keys` are the
        state's tensors the checkpoint lacks, `unexpected_keys` the
        checkpoint's that the state lacks); a numpy array is writable; no
        tensor is an expanded view (stride 0: its elements share memory) and
        no two share memory unless they are the very same view (tied
        weights, written with each name's bytes in turn).

        Host tensors: the sidecar reads the checkpoint into a load region,
        verifying every checksum (a damaged `latest` falls back to the newest
        good checkpoint, as load() does), and only then are the bytes copied
        into `state`: a damaged checkpoint never leaves it half overwritten.
        The region is one a finished load() left free if one is large
        enough, else a new one freed before this returns: no second copy of
        the state outlives the call. Tensors lying contiguous in this
        client's shared memory (after share()) are written by the sidecar
        itself when the index alone checks every tensor: one Load request,
        the checkpoint verified whole in the sidecar's staging before any
        write, the other host tensors through a bounce region sized for them
        alone. Device tensors (contiguous; a strided one is refused) are
        written by the sidecar straight into their GPU memory (host-to-device
        on its own stream, finished before this returns). Nothing may write
        the tensors of `state` meanwhile, nor while a save of them is not yet
        released. See docs/python.md, "Loading into the trainer's
        tensors"."""
        with self._mu:
            self._ensure()
            want = step_arg(step, latest_ok=True)
            want = -1 if want is None else want
            # The sidecar writes shared and device tensors in place, no version bump.
            self._forget_unchanged()
            mine, direct = self._leaves_to_load(state)
            host = [n for n in mine if n not in {d[2].name for d in direct}]
            # Some host tensors in shared memory, and every tensor checked by
            # the index alone (no dtype safetensors lacks, whose real dtype
            # only the structure blob says): one Load request writes them all,
            # the rest into a small bounce region (the sidecar verifies the
            # whole checkpoint before it writes anything). Else the packed way.
            one_request = any(not d[3] for d in direct) and all(_index_checkable(r) for r, _ in mine.values())
            held = _Held()
            try:
                found = self._load_into_one_request(want, mine, direct, host, strict, held) if one_request else None
                if found is None:
                    found = self._load_into_packed(want, mine, direct, strict, held)
                got, missing, unexpected = found
                for name, src in held.srcs.items():
                    if src is not None:
                        _copy_into(*mine[name], src)
            finally:
                # The views of the region go first: a pool region is then
                # free again, a new one unmapped as its mapping is dropped.
                held.srcs = held.lease = None
                if held.target is not None and held.target not in self._load_pool:
                    self._drop_load_region(held.target)
                if held.bounce is not None:
                    self._free_region(held.bounce)
            self.last_load_step = got
            return LoadedInto(got, self.last_load_source, missing, unexpected)

    def _leaves_to_load(self, state: Any) -> tuple[dict[str, tuple[Any, Any]], list[Any]]:
        """load_into's leaves of `state`: ({name: (ref, obj)}, direct), direct
        being (address, nbytes, ref, is device memory) of the leaves the
        sidecar writes itself: device tensors, and host ones lying contiguous
        in this client's regions (after share()), none overlapping another.
        InvalidArgument for a leaf that cannot be written."""
        torch = torch_module()
        fl = Flattener()
        fl.walk(state)
        mine, direct = {}, []
        for ref, obj in fl.leaves:
            dev = _cuda.device_leaf(ref, obj, torch)
            if dev is not None:
                if not dev[2]:
                    raise InvalidArgument(
                        f"load_into: tensor {ref.name!r} is a non-contiguous CUDA tensor "
                        "(the sidecar writes device memory as one range); nothing was loaded"
                    )
                direct.append((dev[0], dev[1], ref, True))
            elif ref.kind == "torch" and obj.device.type != "cpu":
                raise InvalidArgument(
                    f"load_into: tensor {ref.name!r} is on device {obj.device}, which this "
                    "package cannot write; nothing was loaded"
                )
            elif ref.kind == "np" and not obj.flags.writeable:
                raise InvalidArgument(f"load_into: array {ref.name!r} is read-only; nothing was loaded")
            elif _leaf_nbytes(ref, obj) and (obj.flags.c_contiguous if ref.kind == "np" else obj.is_contiguous()):
                addr = obj.__array_interface__["data"][0] if ref.kind == "np" else obj.data_ptr()
                if self._region_of(addr, _leaf_nbytes(ref, obj)) is not None:
                    direct.append((addr, _leaf_nbytes(ref, obj), ref, False))
            mine[ref.name] = (ref, obj)
        why = _alias.aliasing_error(fl.leaves, _cuda.device_leaf, torch)
        if why is not None:
            raise InvalidArgument(f"load_into: {why}; nothing was loaded")
        # The sidecar refuses overlapping destinations (views of one
        # storage, tied weights): host leaves after the first are copied.
        direct.sort(key=lambda d: d[:2])
        kept, end = [], 0
        for d in direct:
            if d[3] or d[0] >= end:
                kept.append(d)
                end = max(end, d[0] + d[1]) if not d[3] else end
        return mine, kept

    def _load_into_one_request(self, want, mine, direct, host, strict, held):
        """load_into in one Load request: the sidecar writes the `direct`
        leaves, and the other `host` ones into a bounce region (held.bounce;
        their bytes in held.srcs). (step, missing_keys, unexpected_keys), or
        None when `latest` was damaged: the packed way then falls back past it."""
        got, infos, _, held.target, _ = self._load_into_region(want, mine, strict, 0)
        missing, unexpected = _match_state(mine, infos, {}, got, strict)
        if held.target not in self._load_pool:
            self._drop_load_region(held.target)
        held.target = None
        have = {i[0]: k for k, i in enumerate(infos)}
        spare = [n for n in host if n in have and infos[have[n]][3]]
        at, total = {}, 0
        for n in spare:
            at[n] = total
            total += align(infos[have[n]][3])
        bounce = held.bounce = self._alloc(total) if total else None
        try:
            # The step found above, explicitly: `latest` may have moved meanwhile.
            self._load_described(
                got,
                infos,
                direct + [(bounce.ptr + at[n], infos[have[n]][3], mine[n][0], False) for n in spare],
            )
            held.srcs = {n: np.frombuffer(bounce.buf, np.uint8, infos[have[n]][3], at[n]) for n in spare}
        except Damaged:
            if want != -1:
                raise
            return None
        return got, missing, unexpected

    def _load_into_packed(self, want, mine, direct, strict, held):
        """load_into the packed way: the checkpoint read once into a load
        region (held.target), the host tensors' bytes views of it (or, for
        tensors stored in slices, copies) in held.srcs, and the device ones
        written by the sidecar. (step, missing_keys, unexpected_keys)."""
        # Host tensors in shared memory are copied too (the
        # checkpoint is read once, into the load region).
        direct = [d for d in direct if d[3]]
        host = [n for n in mine if n not in {d[2].name for d in direct}]
        # A first guess at the region the checkpoint needs: the host
        # tensors' bytes plus room for shard headers; a wrong guess
        # costs one more request (the reply says what it needs).
        guess = sum(_leaf_nbytes(*mine[n]) for n in host)
        guess += (guess >> 30) * 8192 + 256 * len(mine) + (64 << 10) if host else 0
        got, infos, offs, held.target, held.lease = self._load_into_region(want, mine, strict, guess)
        skel = self._loaded_blob(STRUCTURE_BLOB) if offs is not None else None
        refs = {}
        if skel is not None:
            version, skeleton = unpickle_skeleton(skel)
            if version in SKELETON_VERSIONS_READ:
                collect_refs(skeleton, refs)
        missing, unexpected = _match_state(mine, infos, refs, got, strict)
        have = {i[0]: k for k, i in enumerate(infos)}
        srcs = held.srcs
        if host and (NOT_PLACED in offs or self._loaded_blob(PARTS_BLOB) is not None):
            # Tensors stored in slices by several ranks (or an older
            # checkpoint's pieces) are put together by the per-tensor
            # path, into its own region, before anything is copied.
            names = [n for n in host if n in have]
            for name, v in self._load_tensors(got, names, "cpu")[1].items():
                srcs[name] = _raw_bytes(v)
        else:
            for name in host:
                if name in have:
                    i = have[name]
                    nbytes = infos[i][3]
                    srcs[name] = np.frombuffer(held.lease, np.uint8, nbytes, offs[i]) if nbytes else None
        if direct:
            self._load_described(got, infos, direct)
        return got, missing, unexpected

    def _load_described(self, step, infos, places):
        """One Load of `step` that the sidecar writes itself: `places` are
        (address, nbytes, ref, is device memory), each tensor named by
        ref.name and described as the checkpoint's `infos` list it (the
        sidecar checks every one, and the whole checkpoint's checksums,
        before writing any)."""
        L = N.lib()
        have = {i[0]: i for i in infos}
        descs, keep, n = (N.Tensor * max(len(places), 1))(), [], 0
        for addr, nbytes, ref, on_device in places:
            if ref.name not in have or nbytes == 0:
                continue
            if on_device:
                rid = ctypes.c_uint32()
                N.check(L.ckpt_register_cuda_range(self._client, addr, nbytes, ctypes.byref(rid)))
            _, dt, shape, _ = have[ref.name]
            bn, bd = ref.name.encode(), dt.encode()
            shp = (ctypes.c_uint64 * max(len(shape), 1))(*shape)
            keep += [bn, bd, shp]
            descs[n] = N.Tensor(bn, bd, shp, len(shape), addr, nbytes)
            n += 1
        if n:
            N.check(L.ckpt_load(self._client, step, descs, n, None, None))

    def _load_into_region(self, want, mine, strict, guess_bytes):
        """load_into's packed load: (step, tensor list, offsets, region,
        lease), the checkpoint read and verified into a free pool region or a
        new one not in the pool (the caller frees it). The state is matched
        against the checkpoint's index as soon as the sidecar names it (before
        any read when the first region, `guess_bytes` at least, was too small).
        With guess_bytes 0 (no host tensors) only the list is asked for
        (offsets None)."""
        L = N.lib()
        got, src, need = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_uint64()
        need.value = max(guess_bytes, 1)
        host = guess_bytes > 0
        target = None
        try:
            for _ in range(LOAD_TRIES_MAX):
                # Without host tensors to copy, a small new region: the reply
                # lists the tensors and nothing is read (unless it is tiny).
                free = [r for r in self._load_pool if host and r.free() and r.region.len_bytes >= need.value]
                if target is None or target.region.len_bytes < need.value:
                    if target is not None and target not in self._load_pool:
                        self._drop_load_region(target)
                    target = min(free, key=lambda r: r.region.len_bytes) if free else self._new_load_region(need.value)
                N.check(
                    L.ckpt_load_packed(
                        self._client,
                        want,
                        ctypes.c_void_p(target.region.ptr),
                        target.region.len_bytes,
                        ctypes.byref(got),
                        ctypes.byref(src),
                        ctypes.byref(need),
                    )
                )
                self._note_load(got.value, src.value)
                infos, offs = self._loaded_table()
                if need.value <= target.region.len_bytes:
                    break
                _match_state(mine, infos, {}, got.value, strict)
                if not host:
                    return got.value, infos, None, target, None
            else:
                raise SidecarError(
                    f"checkpoint {got.value} kept needing a larger region ({need.value} bytes); try again"
                )
            lease = (ctypes.c_ubyte * max(need.value, 1)).from_buffer(target.mm)
            return got.value, infos, offs, target, lease
        except BaseException:
            if target is not None and target not in self._load_pool:
                self._drop_load_region(target)
            raise


def _dtype_name(dt):
    """A dtype as a user reads it: numpy and torch dtypes of the same values
    have the same name ("float32"); a non-native numpy one its code (">f4")."""
    if isinstance(dt, np.dtype):
        return dt.name if dt.isnative or dt.itemsize == 1 else dt.str
    return str(dt).replace("torch.", "")


def _leaf_nbytes(ref, obj):
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if ref.kind == "torch":
        return obj.numel() * obj.element_size()
    return int(np.prod(ref.shape, dtype=np.int64)) * np.dtype(ref.dtype).itemsize


def _index_checkable(ref):
    """Whether the checkpoint's index alone says a leaf's dtype: not one
    safetensors lacks (stored as U8 bytes, the real dtype in the skeleton)."""
    return ref.stored != "U8" or _dtype_name(ref.dtype) == "uint8"


def _stored_shape(ref, obj):
    """The shape save() gives leaf `obj` in the checkpoint's index ([nbytes]
    for a dtype safetensors lacks, stored as U8)."""
    if ref.stored != "U8" or _dtype_name(ref.dtype) == "uint8":
        return [int(d) for d in ref.shape]
    return [_leaf_nbytes(ref, obj)]


def _names(names, most=8):
    shown = ", ".join(repr(n) for n in names[:most])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > most else ''}]"


def _match_state(mine, infos, refs, step, strict):
    """load_into's check of the state's leaves `mine` ({name: (ref, obj)})
    against checkpoint `step`'s tensors `infos` (and the skeleton's `refs`,
    when known): (missing_keys, unexpected_keys), or InvalidArgument naming
    the first tensor that differs (or, with `strict`, the names either
    lacks)."""
    have = {name: (dt, shape) for name, dt, shape, _ in infos}
    for name, (ref, obj) in mine.items():
        if name not in have:
            continue
        dt, shape = have[name]
        r = refs.get(name)
        if r is not None:
            ck = f"{_dtype_name(r.dtype)} {list(r.shape)}"
        elif dt == "U8" and _dtype_name(ref.dtype) != "uint8":
            ck = f"{shape[0] if shape else 0} raw bytes (a dtype safetensors lacks)"
        else:
            ck = f"{ST_NAMES.get(dt, dt)} {list(shape)}"
        st = f"{_dtype_name(ref.dtype)} {list(ref.shape)}"
        if (
            ref.stored != dt
            or _stored_shape(ref, obj) != list(shape)
            or r is not None
            and (_dtype_name(r.dtype) != _dtype_name(ref.dtype) or tuple(r.shape) != tuple(ref.shape))
        ):
            if ck == st:  # the same to the eye: say how each is stored
                ck, st = f"{ck} stored as {dt} {list(shape)}", f"{st} stored as {ref.stored} {_stored_shape(ref, obj)}"
            raise InvalidArgument(
                f"load_into: tensor {name!r} is {ck} in checkpoint {step} but {st} in the state; nothing was loaded"
            )
    missing = sorted(n for n in mine if n not in have)
    unexpected = sorted(n for n in have if n not in mine)
    if strict and (missing or unexpected):
        said = ([f"lacks {len(missing)} tensor(s) of the state {_names(missing)}"] if missing else []) + (
            [f"holds {len(unexpected)} tensor(s) the state lacks {_names(unexpected)}"] if unexpected else []
        )
        raise InvalidArgument(
            f"load_into: checkpoint {step} {' and '.join(said)}; nothing was loaded "
            "(strict=False loads the tensors both hold)"
        )
    return missing, unexpected


def _raw_bytes(v):
    """A loaded array/tensor's bytes in C order, as a uint8 numpy array (None when empty)."""
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v).reshape(-1).view(np.uint8) if v.nbytes else None
    if v.numel() == 0:
        return None
    torch = torch_module()
    return v.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _copy_into(ref: Any, obj: Any, src: Any) -> None:
    """Copies checkpoint bytes `src` (a uint8 numpy array in C order, checked
    to be the leaf's size) into leaf `obj` in place, through its strides."""
    if ref.kind == "np":
        np.copyto(obj, src.view(obj.dtype).reshape(obj.shape), casting="no")
        return
    torch = torch_module()
    raw = torch.from_numpy(src)
    if raw.data_ptr() % obj.element_size():
        raw = raw.clone()  # not aligned to the element size: torch cannot view it
    # copy_ through a detached alias: autograd's version counter moves as for
    # any in-place write, and a Parameter's requires_grad does not refuse it.
    obj.detach().copy_(raw.view(obj.dtype).view(obj.shape))
