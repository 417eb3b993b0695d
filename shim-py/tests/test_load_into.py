"""Checkpointer.load_into(state): a checkpoint restored into the tensors and
arrays the state already holds, in place. Bit-exact from disk and from RAM,
each leaf keeps its object and memory (strided ones written through their
strides); a mismatch of any tensor (name, dtype, shape, strictness, a
read-only array) is refused before a byte of the state changes; a damaged
checkpoint never reaches the state (latest falls back); no load region
outlives the call unless load() left it in the pool."""
import numpy as np
import pytest

import ckpt_sidecar as cs
from ckpt_test_util import largest_shard
from ckpt_sidecar.errors import Damaged, InvalidArgument

torch = pytest.importorskip("torch")


def _state(seed, raw=True):
    """raw: with leaves of dtypes safetensors lacks (complex, big-endian),
    stored as bytes, whose real dtype only the checkpoint's structure says."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    s = {
        "model": {
            "w": torch.randn(257, 129, generator=g),
            "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
            "cplx": torch.randn(33, generator=g, dtype=torch.complex64),
            "p": torch.nn.Parameter(torch.randn(64, generator=g)),
            "scalar": torch.tensor(seed, dtype=torch.int64),
            "empty": torch.zeros(0, 4),
        },
        "opt": {
            "m": rng.standard_normal(1 << 20).astype(np.float32),
            "u8": rng.integers(0, 256, 4097, dtype=np.uint8),
            "big_endian": rng.standard_normal(100).astype(">f8"),
            "flags": rng.integers(0, 2, 77).astype(np.bool_),
        },
        "step": seed,
    }
    if not raw:
        del s["model"]["cplx"], s["opt"]["big_endian"]
    return s


def _zeros_like(s):
    """A state of the same structure, zero-filled; two leaves strided (a
    transposed torch tensor, a numpy array over every other element)."""
    out = {"model": {}, "opt": {}, "step": 0}
    for k, v in s["model"].items():
        z = torch.zeros_like(v.detach())
        out["model"][k] = torch.nn.Parameter(z) if isinstance(v, torch.nn.Parameter) else z
    out["model"]["w"] = torch.zeros(129, 257).t()
    for k, v in s["opt"].items():
        out["opt"][k] = np.zeros_like(v)
    out["opt"]["flags"] = np.zeros(154, np.bool_)[::2]
    return out


def _leaves(s):
    return [(f"model.{k}", v) for k, v in s["model"].items()] + [(f"opt.{k}", v) for k, v in s["opt"].items()]


def _bytes(v):
    if isinstance(v, np.ndarray):
        return v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes()
    v = v.detach().contiguous()
    return str(v.dtype), tuple(v.shape), v.reshape(-1).view(torch.uint8).numpy().tobytes()


def _addr(v):
    return v.__array_interface__["data"][0] if isinstance(v, np.ndarray) else v.data_ptr()


def _snapshot(s):
    return {name: _bytes(v) for name, v in _leaves(s)}


def _assert_equal(want, got):
    for (name, a), (_, b) in zip(_leaves(want), _leaves(got)):
        assert _bytes(a) == _bytes(b), f"{name} differs"


def test_load_into_is_bit_exact_in_place_from_disk_and_from_ram(ck):
    s1, s2 = _state(1), _state(2)
    ck.save(1, s1).wait_durable(30)
    ck.save(2, s2).wait_durable(30)
    for step, source, want in ((1, "disk", s1), ("latest", "ram", s2)):
        target = _zeros_like(want)
        objs = [(name, v, _addr(v)) for name, v in _leaves(target)]
        got = ck.load_into(target, step)
        assert got == want["step"] and got.step == want["step"] and got.source == source, repr(got)
        assert got.missing_keys == [] and got.unexpected_keys == []
        _assert_equal(want, target)
        for (name, v, addr), (_, now) in zip(objs, _leaves(target)):
            assert now is v and _addr(now) == addr, f"{name} was replaced, not written in place"
        assert isinstance(target["model"]["p"], torch.nn.Parameter) and target["model"]["p"].requires_grad
        assert target["step"] == 0  # not a tensor: left alone
    assert ck.last_load_step == 2 and ck.last_load_source == "ram"


def test_no_load_region_outlives_load_into_unless_load_left_it_free(ck):
    s = _state(1)
    ck.save(1, s).wait_durable(30)
    regions = len(ck._regions)
    ck.load_into(_zeros_like(s))
    assert ck._load_pool == [] and len(ck._regions) == regions, "a second copy of the state stayed alive"
    ck.load()  # dropped at once: load() leaves a free region in its pool ...
    pool = list(ck._load_pool)
    regions = len(ck._regions)
    target = _zeros_like(s)
    ck.load_into(target)  # ... which load_into reads into, and leaves free
    _assert_equal(s, target)
    assert ck._load_pool == pool and len(ck._regions) == regions and all(r.free() for r in pool)


@pytest.mark.parametrize("change, said", [
    (lambda t: t["opt"].__setitem__("u8", np.zeros(4098, np.uint8)), "'opt.u8' is uint8 [4097] in checkpoint 1 but uint8 [4098]"),
    (lambda t: t["opt"].__setitem__("m", np.zeros(1 << 20, np.float64)), "'opt.m' is float32 [1048576] in checkpoint 1 but float64"),
    (lambda t: t["model"].__setitem__("cplx", torch.zeros(66, dtype=torch.float32)), "'model.cplx'"),
    (lambda t: t["model"].__setitem__("cplx", torch.zeros(3, 11, dtype=torch.complex64)),
     "'model.cplx' is complex64 [33] in checkpoint 1 but complex64 [3, 11]"),
    (lambda t: t["opt"].__setitem__("big_endian", np.zeros(100, "<f8")), "'opt.big_endian'"),
    (lambda t: t["opt"].pop("flags"), "holds 1 tensor(s) the state lacks ['opt.flags']"),
    (lambda t: t["opt"].__setitem__("extra", np.zeros(3)), "lacks 1 tensor(s) of the state ['opt.extra']"),
    (lambda t: t["opt"]["u8"].setflags(write=False), "array 'opt.u8' is read-only"),
])
def test_a_mismatch_is_refused_in_one_line_before_the_state_changes(ck, change, said):
    s = _state(1)
    ck.save(1, s).wait_durable(30)
    for first in (True, False):
        target = _zeros_like(s)
        for _name, v in _leaves(target):
            if isinstance(v, np.ndarray):
                v.fill(3)
            else:
                v.detach().fill_(3)
        change(target)
        before = _snapshot(target)
        if not first:
            ck.load()  # dropped at once: a free pool region fits, no sizing reply, checked after the read
        with pytest.raises(InvalidArgument) as e:
            ck.load_into(target, 1)
        msg = str(e.value)
        assert said in msg and "\n" not in msg and "nothing was loaded" in msg, msg
        assert _snapshot(target) == before, "the state changed although the load was refused"


def test_non_strict_loads_the_tensors_both_hold_and_names_the_others(ck):
    s = _state(1)
    ck.save(1, s).wait_durable(30)
    target = {"model": {"w": torch.zeros(257, 129), "new_head": torch.full((3,), 5.0)}, "opt": {"m": np.zeros(1 << 20, np.float32)}}
    got = ck.load_into(target, strict=False)
    assert got == 1
    assert got.missing_keys == ["model.new_head"]
    assert got.unexpected_keys == sorted(n for n, _ in _leaves(s) if n not in ("model.w", "opt.m"))
    assert torch.equal(target["model"]["w"], s["model"]["w"]) and np.array_equal(target["opt"]["m"], s["opt"]["m"])
    assert torch.equal(target["model"]["new_head"], torch.full((3,), 5.0))  # not in the checkpoint: untouched
    with pytest.raises(InvalidArgument, match="lacks 1 tensor.*'model.new_head'.*strict=False"):
        ck.load_into(target)


@pytest.mark.parametrize("shared", [False, True], ids=["copied", "shared"])
def test_a_damaged_checkpoint_never_reaches_the_state_and_latest_falls_back(tmp_path, sidecar, shared):
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    s1, s2 = _state(1, raw=not shared), _state(2, raw=not shared)
    ck.save(1, s1).wait_durable(30)
    ck.save(2, s2).wait_durable(30)
    ck.close()
    sidecar.stop()  # step 2 is no longer resident: loads read the disk
    shard = largest_shard(sidecar.dir / "step-000000000002")
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # near the end: the tensors before it were read and matched
    shard.write_bytes(bytes(data))
    sidecar.start()
    ck = cs.Checkpointer(socket=sidecar.socket, spawn=False)
    try:
        target = _zeros_like(s2)
        if shared:
            ck.share(target["model"])  # the sidecar writes these itself
        before = _snapshot(target)
        with pytest.raises(Damaged, match="checksum mismatch"):
            ck.load_into(target, 2)
        assert _snapshot(target) == before, "a damaged checkpoint was partly copied into the state"
        with pytest.warns(RuntimeWarning, match="loaded step 1, not a newer checkpoint that does not load .*step 2 is damaged"):
            got = ck.load_into(target)
        assert got == 1 and got.source == "disk"
        _assert_equal(s1, target)
    finally:
        ck.close()


@pytest.mark.parametrize("raw", [False, True], ids=["index-checked", "raw-dtypes"])
def test_shared_tensors_are_written_by_the_sidecar_and_the_rest_copied(ck, monkeypatch, raw):
    from ckpt_sidecar import _load_into as checkpointer

    s = _state(1, raw=raw)
    s["model"]["alias"] = s["model"]["bf16"]
    ck.save(1, s).wait_durable(30)
    target = _zeros_like(s)
    ck.share(target["model"])  # contiguous ones now lie in this client's regions
    target["model"]["alias"] = target["model"]["bf16"]  # the same memory twice: the sidecar refuses overlaps
    objs = [(name, v, _addr(v)) for name, v in _leaves(target)]
    copied = []
    real = checkpointer._copy_into
    monkeypatch.setattr(checkpointer, "_copy_into", lambda ref, obj, src: (copied.append(ref.name), real(ref, obj, src)))
    assert ck.load_into(target, 1) == 1
    _assert_equal(s, target)
    for (name, v, addr), (_, now) in zip(objs, _leaves(target)):
        assert now is v and _addr(now) == addr, name
    if raw:
        # A dtype only the structure blob says (complex64 stored as bytes) is
        # checked after the read: the packed way, every tensor copied.
        assert sorted(copied) == sorted(n for n, v in _leaves(target) if _bytes(v)[2]), copied
    else:
        # Shared (share() made the transposed one contiguous): written by the
        # sidecar in one request. The second view of one memory and the
        # arrays outside shared memory: through a bounce region, copied.
        assert sorted(copied) == ["model.alias", "opt.flags", "opt.m", "opt.u8"], copied
    assert ck._load_pool == []


def test_a_resumed_model_and_optimizer_continue_bit_identically(ck):
    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return m, opt

    def step(m, opt, i):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    m, opt = make(0)
    for i in range(3):
        step(m, opt, i)
    ck.save(3, {"model": m.state_dict(), "optim": opt.state_dict()}).wait_durable(30)
    step(m, opt, 3)  # the run goes on: what the resumed one must reproduce
    # A resumed trainer: another initialisation, its optimizer state already
    # created (one step), then restored in place.
    m2, opt2 = make(1)
    step(m2, opt2, 99)
    params = [p.data_ptr() for p in m2.parameters()]
    assert ck.load_into({"model": m2.state_dict(), "optim": opt2.state_dict()}) == 3
    assert [p.data_ptr() for p in m2.parameters()] == params
    step(m2, opt2, 3)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        for p, p2 in zip(m.parameters(), m2.parameters()):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k]), k


def test_load_into_refuses_an_expanded_target_or_overlapping_targets_before_writing(ck):
    # An expanded target (stride 0) had the keys before
    # it written, then failed with torch's raw RuntimeError; two targets
    # overlapping in memory loaded "successfully", the last write winning.
    # Both are refused before a byte of the state changes, naming the tensors.
    s = {"a": torch.arange(12.0), "b": torch.arange(12.0) + 100}
    ck.save(1, s).wait_durable(30)
    first = torch.full((12,), -1.0)
    expanded = {"a": first, "b": torch.full((1,), -2.0).expand(12)}
    with pytest.raises(InvalidArgument, match=r"load_into: tensor 'b' is an expanded view \(stride 0.*nothing was loaded"):
        ck.load_into(expanded, 1)
    assert torch.equal(first, torch.full((12,), -1.0)), "a key before the expanded one was written"
    buf = torch.full((18,), -1.0)
    with pytest.raises(InvalidArgument, match="tensors 'a' and 'b' overlap in memory.*nothing was loaded"):
        ck.load_into({"a": buf[0:12], "b": buf[6:18]}, 1)
    assert torch.equal(buf, torch.full((18,), -1.0))
    arr = np.full(18, -1.0, np.float32)
    with pytest.raises(InvalidArgument, match="overlap in memory"):
        ck.load_into({"a": arr[0:12], "b": arr[6:18]}, 1)
    assert (arr == -1.0).all()
    # Views of one storage that share no byte (the halves of a fused
    # weight, interleaved row by row) and the very same view twice (tied
    # weights) still load.
    ck.save(2, {"q": torch.arange(12.0).reshape(4, 3), "k": -torch.arange(12.0).reshape(4, 3),
                "tied": torch.ones(5), "tied2": torch.ones(5)}).wait_durable(30)
    fused, tied = torch.zeros(4, 6), torch.zeros(5)
    assert ck.load_into({"q": fused[:, :3], "k": fused[:, 3:], "tied": tied, "tied2": tied}, 2) == 2
    assert torch.equal(fused[:, :3], torch.arange(12.0).reshape(4, 3))
    assert torch.equal(fused[:, 3:], -torch.arange(12.0).reshape(4, 3))
    assert torch.equal(tied, torch.ones(5))
