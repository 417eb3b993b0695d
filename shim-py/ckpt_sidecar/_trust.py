"""incremental="trust-version": torch's version counters as proof that a tensor
did not change since an earlier save (docs/python.md, "Incremental saves").

A torch tensor's `_version` is bumped by every in-place operation through
torch (on the tensor or any view of it: views share the counter), also
under torch.no_grad(). So the same tensor object, over the same storage at
the same place (data pointer, storage, offset, shape, strides, dtype,
device), with the same `_version` as when a save took it, holds the same
bytes, unless something wrote them behind torch's back (`.data`, numpy or
DLPack views, raw pointers, kernels outside torch: docs/python.md lists
them). Numpy arrays and other objects have no counter and are never
trusted; neither are inference tensors (no counter).

Two uses, both within one kept save plan (`_SavePlan`: the same state saved
again):
- flags: a tensor whose stamp equals its stamp at the newest save of the
  plan not known to have failed is sent flagged unchanged since that step
  (`ckpt_save_flagged`); the sidecar honours the flag only against that
  step as it committed it from this connection, else copies the tensor, so
  a failed save never lends its stamps;
- slots: a tensor copied at save into a save region (not `share()`d) is
  not copied again when that region's slot for it still holds the bytes of
  the same stamp (`Slots`), so the trainer's own copy is skipped too.
Anything that may write tensors without a version bump (load_into, whose
sidecar writes land in shared tensors directly; rollback) forgets both.
"""

import ctypes
import weakref

from . import _native as N

# Saves remembered for their stamps (the newest few: a flag needs the newest).
RECORDS_MAX = 4


def stamp(ref, obj, old=None):
    """The identity and version of a torch tensor leaf now, or None when it
    cannot be trusted (numpy, __cuda_array_interface__ objects, inference
    tensors). A stamp is (facts, tensor weakref, storage weakref): facts =
    (storage, data pointer, storage offset, shape, strides, dtype, device,
    version). `old`: the leaf's stamp at an earlier save, returned as is when
    it still holds (same() is then true), so its weak references are kept."""
    if ref.kind != "torch":
        return None
    try:
        version = obj._version
        storage = obj.untyped_storage()
        facts = (
            storage._cdata,
            obj.data_ptr(),
            obj.storage_offset(),
            tuple(obj.shape),
            obj.stride(),
            obj.dtype,
            obj.device,
            version,
        )
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        # An inference tensor (no version counter), or a tensor subclass
        # without a plain storage: never trusted.
        return None
    if old is not None and old[0] == facts and _same_tensor(old, obj, version):
        return old
    from torch.multiprocessing.reductions import StorageWeakRef

    # The storage's weak reference keeps its StorageImpl's address from being
    # reused by another storage while the stamp lives (not its memory).
    return (facts, weakref.ref(obj), StorageWeakRef(storage))


def _same_tensor(old, obj, version):
    """Whether `obj` (whose facts equal stamp `old`'s) is the tensor stamped:
    the very object, or another over the same, still living storage with the
    same version counter value above 0 (a fresh state_dict() detaches the
    parameters again, and detach() shares the counter; a `.data` alias has a
    counter of its own, starting at 0: docs/python.md)."""
    if old[1]() is obj:
        return True
    return version > 0 and not old[2].expired()


def same(old, new, obj):
    """Whether stamp `old` (taken earlier) still holds for `obj`, stamped `new` now."""
    if old is None or new is None:
        return False
    return new is old or (old[0] == new[0] and _same_tensor(old, obj, new[0][7]))


def names_of(plan):
    """The tensor names of a plan, in its order (kept on the plan)."""
    if plan.trust_names is None:
        plan.trust_names = tuple(r.name for r in plan.leaf_refs)
    return plan.trust_names


def stamps_of(objs, plan, old=None):
    """The stamp of every leaf of a plan (None where not trusted); `old`: the
    stamps of an earlier save of the plan, kept where they still hold."""
    refs = plan.leaf_refs
    if old is None:
        return [stamp(r, o) for r, o in zip(refs, objs)]
    return [stamp(r, o, s) for r, o, s in zip(refs, objs, old)]


class Tracker:
    """The stamps of this Checkpointer's recent saves, and their outcome."""

    def __init__(self):
        self.records = []  # [save id, plan, step, stamps], oldest first

    def forget(self):
        self.records = []

    def settle(self, client):
        """Drops the records of saves that failed (as far as known now)."""
        keep = []
        st = ctypes.c_int()
        for rec in self.records:
            if N.lib().ckpt_poll(client, rec[0], ctypes.byref(st)) != N.OK or st.value == N.FAILED:
                continue  # failed, or forgotten by the client: its stamps never count
            keep.append(rec)
        self.records = keep[-RECORDS_MAX:]

    def base(self, plan):
        """The record of the newest save of `plan` (or of a plan of the same
        tensor names in the same order: a state's first plan is made again
        once its save region exists) not known to have failed."""
        for r in reversed(self.records):
            if r[1] is plan or names_of(r[1]) == names_of(plan):
                return r
        return None

    def flags(self, plan, objs, now):
        """(since step, ctypes uint32 array of flags) against the newest save
        of `plan` not known to have failed; None when no tensor is flagged."""
        base = self.base(plan)
        if base is None:
            return None
        old = base[3]
        flags = [N.TENSOR_UNCHANGED if same(old[i], now[i], objs[i]) else 0 for i in range(len(now))]
        if not any(flags):
            return None
        return base[2], (ctypes.c_uint32 * len(flags))(*flags)

    def sent(self, save_id, plan, step, now):
        self.records.append([save_id, plan, step, now])
        del self.records[:-RECORDS_MAX]


def clear_slots(region):
    """What a save region holds is no longer known (written otherwise)."""
    if region is not None:
        region.filled = None
