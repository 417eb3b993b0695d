"""load(): the sidecar reads the checkpoint straight into a load region and
the tensors come back as views of it. Bit-exact from disk and from RAM, a
flipped byte still caught, and the lifetime rule: a loaded tensor is never
overwritten by a later load or save, and stays valid after close()."""

import warnings

import numpy as np
import pytest

import ckpt_sidecar as cs
from ckpt_test_util import largest_shard
from ckpt_sidecar.errors import Damaged


def _state(seed):
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal((257, 129)).astype(np.float32),
        "f16": rng.standard_normal(1000).astype(np.float16),
        "i64": rng.integers(-(1 << 60), 1 << 60, 333, dtype=np.int64),
        "u8": rng.integers(0, 256, 4097, dtype=np.uint8),
        "bool": rng.integers(0, 2, 77).astype(np.bool_),
        "empty": np.zeros((0, 3), np.float64),
        "nested": {"big": rng.standard_normal(1 << 20).astype(np.float32)},
        "step": seed,
    }


def _same_bytes(a, b):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], dict):
            _same_bytes(a[k], b[k])
        elif isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"
        else:
            assert a[k] == b[k], k


def test_load_is_bit_exact_from_disk_and_from_ram(ck):
    s1, s2 = _state(1), _state(2)
    ck.save(1, s1).wait_durable(30)
    ck.save(2, s2).wait_durable(30)
    back = ck.load(1)  # not resident: from disk
    assert ck.last_load_source == "disk" and ck.last_load_step == 1
    _same_bytes(s1, back)
    latest = ck.load()  # resident: from RAM
    assert ck.last_load_source == "ram" and ck.last_load_step == 2
    _same_bytes(s2, latest)
    _same_bytes(s1, back)  # the first load's arrays were not touched by the second


def test_a_flipped_byte_is_caught_and_latest_falls_back(tmp_path, sidecar):
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    s1, s2 = _state(1), _state(2)
    ck.save(1, s1).wait_durable(30)
    ck.save(2, s2).wait_durable(30)
    ck.close()
    sidecar.stop()  # step 2 is no longer resident: loads read the disk
    shard = largest_shard(sidecar.dir / "step-000000000002")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    sidecar.start()
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    try:
        with pytest.raises(Damaged, match="checksum mismatch"):
            ck.load(2)
        # Said: the run resumes from an older step than its newest checkpoint.
        with pytest.warns(
            RuntimeWarning,
            match=r"loaded step 1, not a newer checkpoint that does not load \(.*step 2 .*checksum mismatch",
        ) as said:
            back = ck.load()
        assert str(said[0].message).count("step 2") == 1, said[0].message  # said once
        assert ck.last_load_step == 1 and ck.last_load_source == "disk"
        assert "step 2 is damaged" in ck.last_load_fell_back
        _same_bytes(s1, back)
        with pytest.warns(RuntimeWarning, match="loaded step 1, not a newer"):
            assert ck.load_tensors(["u8"])["u8"].tobytes() == s1["u8"].tobytes()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.load(1)  # the step asked for: nothing passed over, nothing said
        assert ck.last_load_fell_back is None
    finally:
        ck.close()


def test_a_loaded_array_stays_intact_after_later_loads_and_saves(ck):
    s1, s2 = _state(1), _state(2)
    ck.save(1, s1).wait_durable(30)
    ck.save(2, s2).wait_durable(30)
    ck.save(3, {"tiny": np.zeros(4)}).wait_durable(30)  # neither 1 nor 2 resident
    a = ck.load(1)
    keep = a["nested"]["big"].copy()
    a["nested"]["big"][:10] = 7.0  # the trainer's own memory now: writable
    keep[:10] = 7.0
    b = ck.load(2)  # must not land in a's region
    assert not np.shares_memory(a["nested"]["big"], b["nested"]["big"])
    ck.save(4, b).wait_durable(30)
    c = ck.load(1)
    assert a["nested"]["big"].tobytes() == keep.tobytes()
    _same_bytes(s2, b)
    _same_bytes(s1, c)
    regions = len(ck._load_pool)
    assert regions == 3  # a, b and c each hold their own
    # Once a load's arrays are all gone its region is reused, not a new one.
    del a, c
    d = ck.load(2)
    _same_bytes(s2, d)
    assert len(ck._load_pool) <= regions
    assert not np.shares_memory(b["nested"]["big"], d["nested"]["big"])


def test_loaded_arrays_stay_valid_after_close(sidecar):
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    s1 = _state(1)
    ck.save(1, s1).wait_durable(30)
    ck.save(2, {"tiny": np.zeros(4)}).wait_durable(30)
    back = ck.load(1)
    ck.close()
    _same_bytes(s1, back)
    back["f32"][:] = 1.0  # still mapped, still writable
    assert float(back["f32"].sum()) == back["f32"].size


def test_loaded_torch_tensors_stay_intact_after_later_loads(ck):
    torch = pytest.importorskip("torch")
    w1 = torch.randn(1 << 18)
    w2 = torch.randn(1 << 18).to(torch.bfloat16)
    ck.save(1, {"w": w1, "p": torch.nn.Parameter(torch.ones(5))}).wait_durable(30)
    ck.save(2, {"w": w2}).wait_durable(30)
    ck.save(3, {"tiny": torch.zeros(1)}).wait_durable(30)
    a = ck.load(1)
    assert torch.equal(a["w"], w1) and isinstance(a["p"], torch.nn.Parameter)
    b = ck.load(2)
    assert b["w"].dtype == torch.bfloat16 and torch.equal(b["w"], w2)
    assert torch.equal(a["w"], w1)  # a's region was not reused while a lives
    assert a["w"].data_ptr() != b["w"].data_ptr()


def _per_tensor_table(ck):
    """The last load's table as ckpt_loaded_tensor and _offset say it, one
    call per tensor."""
    import ctypes

    from ckpt_sidecar import _native as N

    L = N.lib()
    n = ctypes.c_size_t()
    N.check(L.ckpt_loaded_tensor_count(ck._client, ctypes.byref(n)))
    rows = []
    for i in range(n.value):
        name, dtype = ctypes.c_char_p(), ctypes.c_char_p()
        shape, ndim, nbytes = ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_uint32(), ctypes.c_uint64()
        N.check(
            L.ckpt_loaded_tensor(
                ck._client,
                i,
                ctypes.byref(name),
                ctypes.byref(dtype),
                ctypes.byref(shape),
                ctypes.byref(ndim),
                ctypes.byref(nbytes),
            )
        )
        at = ctypes.c_uint64()
        N.check(L.ckpt_loaded_tensor_offset(ck._client, i, ctypes.byref(at)))
        dims = [shape[k] for k in range(ndim.value)]
        rows.append((name.value.decode(), dtype.value.decode(), dims, nbytes.value, at.value))
    return rows


def test_the_load_table_read_in_one_piece_is_what_the_per_tensor_calls_say(ck):
    # Names of every length, each dtype, 0-d, empty and many-dimensional
    # shapes, from RAM and from disk: the columns load() reads in a few
    # calls must be the table a call per tensor reads.
    rng = np.random.default_rng(5)
    dtypes = [np.float32, np.float16, np.int64, np.uint8, np.bool_, np.float64, np.int8]
    state = {}
    for i in range(300):
        dt = dtypes[i % len(dtypes)]
        shape = [(), (0, 3), (2, 1, 1, 1, 1, 1, 1, 2), (i % 17 + 1,), (3, i % 5 + 1)][i % 5]
        state["k" * (i % 40) + f".t{i}"] = rng.integers(0, 100, shape).astype(dt)
    ck.save(1, state).wait_durable(30)
    ck.save(2, {"other": np.zeros(4, np.float32)}).wait_durable(30)
    for step, source in ((1, "disk"), (2, "ram"), (1, "disk")):
        if step == 2:
            ck.save(3, state).wait_durable(30)
            step = 3
        back = ck.load(step)
        assert ck.last_load_source == source
        names, dts, nbytes, offs, shape_of = ck._loaded_columns()
        cols = [(nm, dt, shape_of(i), nb, off) for i, (nm, dt, nb, off) in enumerate(zip(names, dts, nbytes, offs))]
        assert cols == _per_tensor_table(ck)
        assert sorted(names) == sorted(state)
        for k, v in state.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and back[k].tobytes() == v.tobytes(), k


def test_a_skeleton_of_version_1_still_loads_and_version_2_is_what_a_save_writes(ck, monkeypatch):
    """Version 2 skeletons give each tensor as a pickle persistent id; a
    checkpoint whose skeleton is version 1 (TensorRef objects, as written
    before) loads the same, by every load path."""
    import pickle

    from ckpt_sidecar import _save, _tree

    state = _state(5)
    state["same"] = [state["f16"], state["f16"]]  # one array at two places
    ck.save(1, state).wait_durable()
    # A version-1 writer: the TensorRefs pickled as objects.
    monkeypatch.setattr(_save, "pickle_skeleton", lambda v, skel: pickle.dumps((1, skel), protocol=4))
    ck.save(2, {**state, "step": 6}).wait_durable()
    monkeypatch.undo()
    for step, want in ((1, state), (2, {**state, "step": 6})):
        got = ck.load(step)
        _same_bytes({k: v for k, v in got.items() if k != "same"}, {k: v for k, v in want.items() if k != "same"})
        assert got["same"][0].tobytes() == got["same"][1].tobytes() == state["f16"].tobytes(), step
        only = ck.load_tensors(["f32", "nested.big"], step)
        assert only["f32"].tobytes() == state["f32"].tobytes(), step
        into = {"f32": np.zeros_like(state["f32"]), "u8": np.zeros_like(state["u8"])}
        ck.load_into(into, step, strict=False)
        assert into["f32"].tobytes() == state["f32"].tobytes() and into["u8"].tobytes() == state["u8"].tobytes()
        version, skel = _tree.unpickle_skeleton(ck._loaded_blob("structure.pkl"))
        assert version == (2 if step == 1 else 1), step
        assert isinstance(skel["f32"], _tree.TensorRef) and skel["f32"].name == "f32"
    # A version-2 blob is not a plain pickle of TensorRefs: read only with its persistent ids.
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(
            _tree.pickle_skeleton(
                _tree.SKELETON_VERSION, {"x": _tree.TensorRef("x", "np", np.dtype("f4"), (1,), "F32")}
            )
        )
