"""Device memory in Checkpointer.save: tensors in CUDA device memory are not
copied to the host by the trainer. Each one's allocation is registered with
the sidecar once (libckpt: cuMemGetAddressRange, legacy IPC handle), the
tensor is described in place as (allocation, offset, length), and the save
records an interprocess event on the stream the tensors were written on
(ckpt_save_on_stream); the sidecar's own stream waits on it and copies.

A leaf is device memory when it is a torch CUDA tensor (its stream: the
device's current stream) or any object exposing `__cuda_array_interface__`
(CuPy, Numba, ...; its `stream` field says which stream to fence on: None
for none, 1 the legacy default stream, 2 the per-thread default stream,
else a stream handle).
"""

import ctypes

import numpy as np

_PLAIN = (dict, list, tuple, str, bytes, int, float, bool, type(None))


def interface(obj):
    """The `__cuda_array_interface__` of an object (a property, as CuPy and
    Numba have, or an attribute), or None."""
    if type(obj) in _PLAIN:
        return None
    try:
        cai = getattr(obj, "__cuda_array_interface__", None)
    except Exception:  # a property refusing (e.g. a host-side object): not device memory
        return None
    return cai if isinstance(cai, dict) and "data" in cai and "shape" in cai and "typestr" in cai else None


def _c_strides(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def device_leaf(ref, obj, torch):
    """(address, nbytes, contiguous, stream) of a leaf in device memory, else None."""
    if ref.kind == "cuda":
        cai = obj.__cuda_array_interface__
        dt = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        contiguous = strides is None or tuple(strides) == _c_strides(shape, dt.itemsize)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        stream = cai.get("stream")
        return int(cai["data"][0]), nbytes, contiguous, 0 if stream is None else int(stream)
    if ref.kind == "torch" and torch is not None and obj.is_cuda:
        # A lazy conjugate or negative view is not its bytes as they lie: copied, not sent in place.
        flat = obj.is_contiguous() and not (obj.is_conj() or obj.is_neg())
        return (
            obj.data_ptr(),
            obj.numel() * obj.element_size(),
            flat,
            torch.cuda.current_stream(obj.device).cuda_stream,
        )
    return None


def streams_now(dev, objs, torch, torch_stream=None):
    """The streams the device leaves `dev` ([(index, ref)] into `objs`) are
    fenced on now: a kept save plan asks again at each save (torch's current
    stream may have changed; one query per device). `torch_stream`: the
    stream (a handle) of every torch CUDA tensor instead of this thread's
    current one (a save sent from another thread than the trainer's)."""
    out, per_device = [], {}
    for i, ref in dev:
        o = objs[i]
        if ref.kind == "cuda":
            s = o.__cuda_array_interface__.get("stream")
            s = 0 if s is None else int(s)
        elif torch_stream is not None:
            s = int(torch_stream)
        else:
            s = per_device.get(o.device)
            if s is None:
                s = per_device[o.device] = torch.cuda.current_stream(o.device).cuda_stream
        if s not in out:
            out.append(s)
    return out


_driver = None


def _cu():
    """The process's CUDA driver (the same libcuda.so.1 libckpt loads)."""
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _in_context_of(cu, ptr, run):
    """Run `run()` with the primary context of the device holding device
    pointer `ptr` current on this thread (the driver refuses these calls
    on a thread with no context: CUDA_ERROR_INVALID_CONTEXT), then put back
    the thread's own context. Returns run()'s CUDA status."""
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    ordinal, dev, ctx, before = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
    r = cu.cuPointerGetAttribute(ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(ptr))
    if r == 0:
        r = cu.cuDeviceGet(ctypes.byref(dev), ordinal.value)
    if r == 0:
        r = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
    if r == 0:
        r = cu.cuCtxGetCurrent(ctypes.byref(before))
    if r != 0:
        return r
    r = cu.cuCtxSetCurrent(ctx)
    try:
        return r if r != 0 else run()
    finally:
        cu.cuCtxSetCurrent(before)
        cu.cuDevicePrimaryCtxRelease_v2(dev)


def copy_to_host(obj, dst_ptr, nbytes, stream):
    """Copy a contiguous `__cuda_array_interface__` object's bytes to host
    memory at `dst_ptr`, after the work queued on its stream (the fallback for
    a device leaf that cannot be described in place: one overlapping another).
    Runs in the primary context of the object's device, whatever context
    this thread has (or none)."""
    cu = _cu()
    src = obj.__cuda_array_interface__["data"][0]

    def run():
        r = cu.cuStreamSynchronize(ctypes.c_void_p(stream if stream > 2 else 0))
        if r == 0:
            r = cu.cuMemcpyDtoH_v2(ctypes.c_void_p(dst_ptr), ctypes.c_uint64(src), ctypes.c_size_t(nbytes))
        return r

    r = _in_context_of(cu, src, run)
    if r != 0:
        from .errors import CudaError

        raise CudaError(f"copying a device tensor to the host failed: CUDA error {r}")
