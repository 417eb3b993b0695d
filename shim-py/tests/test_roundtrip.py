"""numpy-only round trips through a real sidecar (no torch needed)."""
import collections
import subprocess
import sys

import numpy as np
import pytest

import ckpt_sidecar as cs

Point = collections.namedtuple("Point", "x y")

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.complex128, ">i4", ">f8", "<U3", "S4",
          "datetime64[ns]", [("a", "<i4"), ("b", "<f2")]]


def _rich_state():
    rng = np.random.default_rng(0)
    arrays = {}
    for i, dt in enumerate(DTYPES):
        dt = np.dtype(dt)
        raw = rng.integers(0, 256, size=(3, 5, dt.itemsize), dtype=np.uint8)
        if dt.kind in "fc":
            a = rng.standard_normal((3, 5)).astype(dt)
        elif dt.kind == "b":
            a = rng.integers(0, 2, (3, 5)).astype(bool)
        else:
            a = raw.view(dt).reshape(3, 5)
        arrays[f"d{i}"] = a
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    return {
        "arrays": arrays,
        "noncontig": {"strided": base[::2, 1::3], "transposed": base.T, "fortran": np.asfortranarray(base),
                      "neg": base[::-1], "view_a": base[1:3], "view_b": base[2:5]},
        "base": base,
        "zero": {"empty": np.zeros((0, 4), np.float32), "empty_c": np.zeros(0, np.complex64),
                 "scalar0d": np.array(7, np.int64), "zero_strided": np.zeros((4, 0))[::2]},
        "plain": {"step": 42, "lr": 3e-4, "name": "run-α", "none": None, "flags": {1, 2}, "bytes": b"\x00\xff",
                  "np_scalar": np.float32(1.5)},
        "seq": [np.ones(3, np.int8), (np.full(2, 9, np.uint16), "t"), Point(np.zeros(1), 2)],
        "odict": collections.OrderedDict([("z", np.arange(2)), ("a", 1)]),
        "obj_array": np.array([{"a": 1}, None], dtype=object),
        3: np.arange(4, dtype=np.int32),            # non-string key
        "a.b": np.arange(1), "a": {"b": np.arange(2)},  # the same dotted path twice
    }


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist(), path
        else:
            assert a.tobytes() == b.tobytes() or np.array_equal(a, b, equal_nan=False), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def test_round_trip_nested_numpy_state(ck):
    state = _rich_state()
    h = ck.save(1, state)
    assert h.step == 1
    h.wait_released(timeout=30)
    h.wait_durable(timeout=30)
    assert h.done() and h.state() == "durable"
    assert h.stall_seconds >= 0 and h.figures()["persist_s"] is not None
    back = ck.load()
    _assert_same(state, back)
    assert ck.last_load_step == 1
    assert ck.list() == [1] and ck.latest() == 1


def test_a_state_of_only_empty_arrays_round_trips(ck):
    # Its shard is a header and nothing else: loading it once called the
    # committed checkpoint damaged ("only 4096 of 4096 bytes checked").
    state = {"e": np.zeros(0, np.float32), "f": np.zeros((0, 5), np.int64)}
    ck.save(3, state).wait_durable(30)
    _assert_same(state, ck.load(3))


def test_arrays_are_named_by_their_path(ck, sidecar):
    import json

    ck.save(5, {"model": {"layers": [{"weight": np.ones((2, 2), np.float32)}]}, "optim": {3: np.zeros(1)}}).wait_durable(30)
    index = json.loads((sidecar.dir / "step-000000000005" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"model.layers.0.weight", "optim.3"}


def test_several_steps_and_load_by_step(ck):
    handles = [ck.save(s, {"w": np.full(1000, s, np.float64), "step": s}) for s in (10, 20, 30)]
    for h in handles:
        h.wait_durable(30)
    assert ck.list() == [10, 20, 30] and ck.latest() == 30
    assert ck.load(20)["step"] == 20 and ck.load(step=20)["w"][0] == 20
    assert ck.load("latest")["step"] == 30


def test_state_may_change_after_release(ck):
    w = np.arange(1000, dtype=np.float32)
    h = ck.save(1, {"w": w})
    # Copied into shared memory by save(): the trainer's array is free at once;
    # the sidecar takes its own copy a little later.
    assert not h.inplace and h.released()
    h.wait_released(30)
    h.wait_taken(30)
    assert h.taken()
    w += 1  # the sidecar has its own copy now
    h.wait_durable(30)
    assert np.array_equal(ck.load(1)["w"], np.arange(1000, dtype=np.float32))


def test_share_sends_arrays_in_place(ck):
    state = {"model": {"w": np.arange(1 << 16, dtype=np.float32), "b": np.ones(7, np.int16)}, "other": [np.zeros(3)]}
    w_before = state["model"]["w"]
    ck.share(state)
    assert state["model"]["w"] is not w_before and np.array_equal(state["model"]["w"], w_before)
    h = ck.save(1, state)
    assert h.copied_bytes == 0 and h.inplace  # nothing copied by the trainer
    h.wait_released(30)
    state["model"]["w"][:] = -1
    h.wait_durable(30)
    assert np.array_equal(ck.load(1)["model"]["w"], w_before)
    # Overlapping views of a shared array: the second is copied, both saved correctly.
    s = state["model"]["w"]
    h = ck.save(2, {"a": s[:100], "b": s[50:150], "nc": s[::2]})
    assert h.copied_bytes > 0
    h.wait_durable(30)
    back = ck.load(2)
    assert np.array_equal(back["b"], s[50:150]) and np.array_equal(back["nc"], s[::2])


def test_errors_are_sidecar_errors(ck):
    ck.save(1, {"w": np.zeros(4)}).wait_durable(30)
    h = ck.save(1, {"w": np.zeros(4)})  # step already committed
    with pytest.raises(cs.BadRequest) as e:
        h.wait_durable(30)
    assert isinstance(e.value, cs.SidecarError) and e.value.code == -9 and "1" in str(e.value)
    with pytest.raises(cs.NotFound):
        ck.load(12345)
    ck.close()
    with pytest.raises(cs.Closed):
        ck.save(2, {})


def test_rng_capture_and_restore(ck):
    import random

    random.seed(1)
    np.random.seed(2)
    ck.save(1, {"x": 1}, rng=True).wait_durable(30)
    expected = (random.random(), np.random.rand())
    random.seed(99)
    np.random.seed(99)
    assert ck.load(1, restore_rng=True) == {"x": 1}
    assert (random.random(), np.random.rand()) == expected


def test_torch_not_imported_by_numpy_use(ck):
    ck.save(1, {"w": np.zeros(3)}).wait_durable(30)
    ck.load(1)
    code = "import ckpt_sidecar, numpy, sys; ckpt_sidecar.Checkpointer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_many_saves_in_flight_reuse_two_regions(ck):
    w = np.zeros(1 << 18, np.float64)  # 2 MiB
    ck.reserve({"w": w})
    assert len(ck._save_regions) == 2 and len(ck._free) == 2
    handles = []
    for s in range(1, 9):
        w[:] = s
        handles.append(ck.save(s, {"w": w}))
    for h in handles:
        h.wait_durable(60)
    assert len(ck._save_regions) <= 2
    assert [ck.load(s)["w"][0] for s in (1, 5, 8)] == [1, 5, 8]


def test_numpy_only_without_torch(tmp_path):
    """`import torch` fails in this interpreter: the package works all the same."""
    code = f"""
import sys
sys.modules["torch"] = None          # import torch now raises ImportError
import numpy as np, ckpt_sidecar as cs
ck = cs.Checkpointer(dir={str(tmp_path / 'ck')!r}, socket={str(tmp_path / 'none.sock')!r}, staging="64MiB")
ck.save(1, {{"w": np.arange(5), "cfg": {{"a": 1}}}}, rng=True).wait_durable(30)
out = ck.load(1, restore_rng=True)
assert out["w"].tolist() == [0, 1, 2, 3, 4] and out["cfg"] == {{"a": 1}}
ck.close()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_too_large_for_staging_fails_that_save_only(ck):
    # Tensors above the sidecar's whole 64 MiB staging are refused by save()
    # itself, before any copy (test_misuse.py); tensors just below it whose
    # file image (headers, alignment) is above it are refused by the sidecar.
    with pytest.raises(cs.TooLarge) as e:
        ck.save(1, {"w": np.zeros(80 << 20, np.uint8)})
    assert e.value.code == -12
    big = np.zeros((64 << 20) - 100, np.uint8)
    h = ck.save(1, {"w": big})
    with pytest.raises(cs.TooLarge) as e:
        h.wait_durable(30)
    assert e.value.code == -12 and str(e.value)
    with pytest.raises(cs.TooLarge):
        h.wait_released(0)  # the failure is known: released-waits report it too
    ck.save(2, {"w": np.ones(3)}).wait_durable(30)  # the next save is fine
    assert ck.list() == [2]


def test_a_state_saved_again_is_saved_as_it_is_now(ck):
    """save() reuses the request it prepared for the same state (same arrays,
    containers, plain values); every change in between still reaches the
    checkpoint: values written in place, a plain value, an array replaced,
    a key added, an array reshaped, a region freed and shared anew."""
    state = {"a": np.arange(1000, dtype=np.float32), "b": np.ones((4, 8), dtype=np.int64), "n": 1, "s": "x"}
    shared = ck.share({"c": np.zeros(256, dtype=np.float64)})
    state["c"] = shared["c"]
    steps = iter(range(1, 100))

    def roundtrip():
        step = next(steps)
        ck.save(step, state).wait_durable(30)
        got = ck.load(step)
        assert set(got) == set(state)
        for k, v in state.items():
            if isinstance(v, np.ndarray):
                assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v), k
            else:
                assert got[k] == v and type(got[k]) is type(v), k

    roundtrip()
    roundtrip()  # unchanged: the prepared request as is
    state["a"][:] = 7  # copied at save: new bytes
    state["c"][:] = 3  # in place: new bytes
    roundtrip()
    state["n"] = 2
    roundtrip()
    state["n"] = True  # equal to 1 as a value, not as a type
    roundtrip()
    state["b"] = np.full((4, 8), 5, dtype=np.int64)
    roundtrip()
    state["b"].shape = (8, 4)
    roundtrip()
    state["d"] = np.arange(3, dtype=np.uint8)
    roundtrip()
    state["a"] = state["a"][::2]  # a strided view: copied through numpy
    roundtrip()
    state["a"] = state["a"].copy()
    roundtrip()


def test_a_state_of_only_arrays_saved_again_is_saved_as_it_is_now(ck):
    """A container whose values are all arrays is described in bulk by the
    prepared-request check: every change the per-value check sees is still
    seen there: bytes written in place, an array reshaped or re-typed in
    place, an array replaced (also by one that may reuse a dead one's id),
    and the same changes in a list of arrays."""
    shared = ck.share({f"w{i}": np.full(64, i, dtype=np.float32) for i in range(6)})
    state = {"m": dict(shared), "l": [np.arange(8, dtype=np.int32), np.arange(8, dtype=np.int32) * 2]}
    steps = iter(range(1, 100))

    def roundtrip():
        step = next(steps)
        ck.save(step, state).wait_durable(30)
        got = ck.load(step)
        for part in ("m", "l"):
            pairs = got[part].items() if part == "m" else enumerate(got[part])
            for k, v in pairs:
                want = state[part][k]
                assert v.dtype == want.dtype and v.shape == want.shape and np.array_equal(v, want), (part, k)

    roundtrip()
    roundtrip()  # unchanged: the prepared request as is
    state["m"]["w1"][:] = 11  # in place
    state["l"][0][:] = -1  # copied at save
    roundtrip()
    state["m"]["w2"].shape = (8, 8)  # reshaped in place: same array object
    state["l"][1].shape = (2, 4)
    roundtrip()
    state["m"]["w3"].dtype = np.int32  # re-typed in place
    roundtrip()
    for _ in range(3):  # replaced: the old array dies, its id may be reused
        state["m"]["w4"] = np.full(64, 4.5, dtype=np.float32)
        state["l"][0] = np.arange(8, dtype=np.int32) + 100
        roundtrip()


def test_alternating_states_each_saved_as_it_is_now_whatever_was_saved_between(ck):
    """Two states saved alternately (each one's prepared request, encoded
    list and sidecar plan kept while the other is saved): a change of one
    between its saves (bytes, an array moved to another address in shared
    memory, reshaped, a key added or removed) reaches its checkpoint, and
    the other's checkpoints stay its own."""
    a = ck.share({f"a{i}": np.full(256, i, dtype=np.float32) for i in range(50)})
    b = ck.share({"w": np.full(1 << 16, 2, dtype=np.float32)})
    spare = ck.share({"s": np.full(256, -1, dtype=np.float32), "t": np.arange(6, dtype=np.int16)})
    steps = iter(range(1, 100))

    def roundtrip(state):
        step = next(steps)
        ck.save(step, state).wait_durable(30)
        got = ck.load(step)
        assert set(got) == set(state), step
        for k, v in state.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v), (step, k)

    def both():
        roundtrip(a)
        roundtrip(b)

    both()
    both()  # each one's kept request, list and plan
    a["a3"][:] = 33
    both()
    a["a4"] = spare["s"]  # another address, same shape and dtype
    both()
    a["a5"].shape = (16, 16)
    both()
    a["new"] = spare["t"]
    both()
    del a["a0"]
    both()
    b["w"][:] = 9
    both()


def test_quick_keys_tell_bulk_containers_apart():
    """The prepared-request key of a container of arrays (built in bulk)
    differs whenever a per-value key would."""
    from ckpt_sidecar._tree import quick_key
    a, b = np.zeros(4, dtype=np.float32), np.zeros(4, dtype=np.float32)

    def key(s):
        return quick_key(s)[0]

    assert key({"a": a, "b": b}) == key({"a": a, "b": b})
    assert key({"a": a, "b": b}) != key({"a": b, "b": a})
    assert key({"a": a, "b": b}) != key({"a": a, "c": b})
    assert key([a, b]) != key((a, b)) and key([a, b]) != key([a, b, a])
    k = key({"a": a, "b": b})
    a.shape = (2, 2)
    assert key({"a": a, "b": b}) != k
    k = key({"a": a, "b": b})
    b.dtype = np.int32
    assert key({"a": a, "b": b}) != k
    assert quick_key({"a": a, "o": np.array([None, 1], dtype=object)}) is None
    leaves = quick_key({"a": a, "b": b})[1]
    assert len(leaves) == 2 and leaves[0] is a and leaves[1] is b


def test_the_native_key_of_arrays_reads_what_their_attributes_say():
    """libckpt keys a list of numpy arrays from their structs (the bulk
    key's fast path): exactly the addresses, shapes, strides and dtypes
    their attributes give, for views, reversed, transposed, 0-d and empty
    arrays; anything not exactly an ndarray is refused (keyed in Python)."""
    from ckpt_sidecar import _native_key

    base = np.arange(120, dtype=np.float32).reshape(6, 20)
    vals = [base, base[::2, 1::3], base.T, np.zeros((), np.int8), np.arange(5)[::-1], np.zeros((3, 0))]
    k = _native_key.arrays_key(vals)
    assert k is not None, "ckpt_py_arrays_key failed its self-check here: quick_key keys arrays in Python"
    assert k == _native_key.expected_key(vals)
    assert _native_key.arrays_key(vals[:2] + [vals[2].copy()]) != _native_key.arrays_key(vals[:3])
    assert _native_key.arrays_key([base, "x"]) is None
    big = [np.zeros(i % 7 + 1) for i in range(5000)]  # past the first output buffer
    assert _native_key.arrays_key(big) == _native_key.expected_key(big)


def test_a_quick_key_leaves_no_garbage_for_the_cycle_collector():
    """The key a save builds to find its prepared request is freed as soon
    as it is dropped: nothing is left for the cycle collector, whose
    collections would otherwise come inside later saves (its walker refers
    to itself; quick_key breaks that cycle). Checked on every shape of
    state the key describes: bulk containers, nested ones, plain values,
    and a state it gives up on."""
    import gc

    from ckpt_sidecar._tree import quick_key
    arrays = {f"w{i}": np.full(4, i, dtype=np.float32) for i in range(50)}
    states = [arrays, {"m": arrays, "l": [np.arange(8), {"x": np.ones(3), "n": 1}], "s": "x"},
              [np.zeros(2), (np.ones(2), 3.5)], {"o": np.array([None], dtype=object)}]
    paused = gc.isenabled()
    gc.disable()
    try:
        while gc.collect():
            pass  # earlier tests' garbage (finalizers may free more)
        for st in states:
            key = quick_key(st)
            del key
            assert gc.collect() == 0
    finally:
        if paused:
            gc.enable()


def test_many_saves_of_shared_tensors_keep_few_handles(ck):
    """Saves whose tensors are all shared never poll their handles on the
    way (nothing to copy): the client still forgets the released ones."""
    state = ck.share({"w": np.zeros(16, dtype=np.float32)})
    for step in range(1, 301):
        state["w"][:] = step
        h = ck.save(step, state).wait_released(30)
    h.wait_durable(60)
    assert len(ck._pending) <= 2 * 64
    assert np.array_equal(ck.load(300)["w"], np.full(16, 300, dtype=np.float32))
