"""Ranks: who this process is in a distributed job, and which part of a
replicated state it saves.

`rank_info()` asks torch.distributed when it is initialised, else the
environment torchrun (and SLURM/Kubernetes launchers through it) sets:
RANK, WORLD_SIZE, LOCAL_RANK.

`partition()` splits a state that every rank holds alike (data parallel)
so that every rank writes a disjoint part of about the same bytes: the
tensors, in a fixed order, are laid end to end and cut into `world_size`
equal byte ranges; a cut that falls within SNAP_FRACTION of a fair share of
a tensor boundary moves to it (that tensor stays whole), any other cut
splits the tensor it falls in at an element boundary. Each rank's bytes
then differ from the fair share by at most 2 × SNAP_FRACTION, and at most
world_size - 1 tensors are split. Every rank computes the same partition
from the same (name, bytes) list, with no communication.
"""

import bisect
import json
import os
from collections import namedtuple

from ._tree import torch_module

SNAP_FRACTION = 0.02
# A part's slice declarations: read by the sidecar into the index's
# `slices` (docs/format.md), never stored as a blob.
SLICES_BLOB = "ckpt.slices.json"

RankInfo = namedtuple("RankInfo", "rank world_size local_rank")

# One contiguous range of one tensor that one rank saves: elements
# [start, stop) of the tensor flattened in row-major order.
Piece = namedtuple("Piece", "rank name start stop")


def rank_info():
    """(rank, world_size, local_rank) of this process."""
    torch = torch_module()
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if torch is not None:
        d = getattr(torch, "distributed", None)
        if d is not None and d.is_available() and d.is_initialized():
            return RankInfo(d.get_rank(), d.get_world_size(), local)
    rank = int(os.environ.get("RANK", "0") or 0)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
    return RankInfo(rank, world, local)


def piece_name(name, start, stop):
    """The stored name of elements [start, stop) of tensor `name`."""
    return f"{name}#elems[{start}:{stop}]"


def partition(items, world_size):
    """items: [(name, nbytes, itemsize, splittable)] in a fixed order.
    Returns {name: [Piece, ...]} covering every tensor exactly once (a whole
    tensor is one piece with start 0 and stop = its element count)."""
    total = sum(n for _, n, _, _ in items)
    out = {}
    if world_size == 1 or total == 0:
        for name, n, isz, _ in items:
            out[name] = [Piece(0, name, 0, n // isz if isz else 0)]
        return out
    fair = total / world_size
    snap = SNAP_FRACTION * fair
    # Tensor boundaries in the byte stream.
    starts, at = [], 0
    for _, n, _, _ in items:
        starts.append(at)
        at += n
    cuts = []
    for k in range(1, world_size):
        c = round(k * fair)
        i = bisect.bisect_right(starts, c) - 1
        _, n, isz, splittable = items[i]
        s, e = starts[i], starts[i] + n
        if s < c < e:
            if not splittable:
                c = s if c - s <= e - c else e
            elif c - s <= snap:
                c = s
            elif e - c <= snap:
                c = e
            else:
                c = s + (c - s) // isz * isz
        cuts.append(max(c, cuts[-1] if cuts else 0))
    bounds = [0] + cuts + [total]
    for (name, n, isz, _), s in zip(items, starts):
        if n == 0:
            r = min(bisect.bisect_right(bounds, s) - 1, world_size - 1)
            out[name] = [Piece(r, name, 0, 0)]
            continue
        pieces = []
        for r in range(world_size):
            lo, hi = max(s, bounds[r]), min(s + n, bounds[r + 1])
            if hi > lo:
                pieces.append(Piece(r, name, (lo - s) // isz, (hi - s) // isz))
        out[name] = pieces
    return out


def bytes_per_rank(parts, sizes, world_size):
    """Bytes each rank saves under `parts` (from partition); sizes: {name: itemsize}."""
    per = [0] * world_size
    for pieces in parts.values():
        for p in pieces:
            per[p.rank] += (p.stop - p.start) * sizes[p.name]
    return per


def _flat(obj, start, stop):
    """Elements [start, stop) of `obj` flattened (a view where it can be)."""
    return obj.reshape(-1)[start:stop]


def select(obj, cut):
    """A leaf as rank_selection chose it: whole (cut None) or elements
    [start, stop) of it flattened."""
    return obj if cut is None else _flat(obj, *cut)


def rank_selection(leaves, rank, world_size):
    """This rank's part of a replicated state's leaves [(TensorRef, obj)]:
    the leaves it saves, whole or an element range under a piece name, as
    [(index in `leaves`, the TensorRef to save it under, None for the whole
    leaf or its (start, stop) element range)] (`select` makes each one's
    object), and the slice declarations of its pieces, as the sidecar reads
    them from the blob SLICES_BLOB (docs/protocol.md, SavePart):
    [{"tensor": piece name, "of": the tensor's name, "shape": its whole
    shape, "elems": [start, stop]}]. A function of the leaves' names,
    dtypes and sizes alone: the same for a state with the same quick key."""
    from ._tree import TensorRef

    items = []
    for ref, obj in leaves:
        if ref.kind == "np":
            n, isz, u8 = obj.nbytes, obj.itemsize, obj.dtype.itemsize == 1
        else:
            n, isz, u8 = obj.numel() * obj.element_size(), obj.element_size(), ref.dtype == "uint8"
        # Raw-byte leaves (dtypes safetensors lacks) stay whole.
        splittable = ref.stored != "U8" or u8
        items.append((ref.name, n, isz, splittable))
    parts = partition(items, world_size)
    chosen, slices = [], []
    for j, (ref, _obj) in enumerate(leaves):
        pieces = parts[ref.name]
        if len(pieces) == 1:
            if pieces[0].rank == rank:
                chosen.append((j, ref, None))
            continue
        for p in pieces:
            if p.rank == rank:
                pn = piece_name(ref.name, p.start, p.stop)
                pref = TensorRef(pn, ref.kind, ref.dtype, (p.stop - p.start,), ref.stored, ref.extra)
                chosen.append((j, pref, (p.start, p.stop)))
                slices.append({"tensor": pn, "of": ref.name, "shape": list(ref.shape), "elems": [p.start, p.stop]})
    return chosen, slices


def slices_blob(slices):
    """The blob of a part's slice declarations (the sidecar's SLICES_BLOB)."""
    return json.dumps({"slices": slices}, separators=(",", ":")).encode()


def rng_blob_name(rank):
    return f"rng.rank-{rank:05d}.pkl"
