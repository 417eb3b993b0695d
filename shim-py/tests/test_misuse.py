"""The Python API misused on purpose, table-driven: bad directories, sizes,
counts and steps, states that cannot be saved, a closed or inherited
Checkpointer. Each case raises one clear exception naming the value, before
anything is created, spawned, copied or sent."""
import gc
import os
import subprocess
import warnings

import numpy as np
import pytest

import ckpt_sidecar as cs
from ckpt_sidecar import _units
from ckpt_test_util import lock_is_free


def tree(root):
    out = set()
    for d, dirs, files in os.walk(root):
        out.update(os.path.join(d, n) for n in dirs + files)
    return out


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("text,want", [
    ("0", 0), ("4096", 4096), ("1B", 1), ("1KB", 1000), ("1000KB", 1_000_000), ("1.5GB", 1_500_000_000),
    ("1.5GiB", 3 << 29), ("2gib", 2 << 30), ("1K", 1024), ("1PiB", 1 << 50), ("1PB", 10**15),
    (" 512MiB ", 512 << 20), ("0.5KiB", 512), (".5KiB", 512),
])
def test_sizes_mean_what_the_command_line_means(text, want):
    # The same table as store/src/units.rs.
    assert _units.parse_size(text) == want


BAD_SIZES = ["", "lots", "1.2.3GiB", "1XB", "-1", "0.3B", "1.0000001KiB", "99999999PiB", "18446744073709551616"]


@pytest.mark.parametrize("text", BAD_SIZES)
def test_bad_sizes_are_refused_in_the_command_lines_words(text, tmp_path):
    with pytest.raises(ValueError) as e:
        _units.parse_size(text)
    msg = str(e.value)
    assert f'"{text}"' in msg
    # The Rust parser (through the binary) says the very same.
    if text.strip() and not text.startswith("-"):
        from ckpt_sidecar import _native

        r = subprocess.run([_native.sidecar_binary(), "bench", "write", "--dir", str(tmp_path / "nx"), "--size", text],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert msg in r.stderr, (msg, r.stderr)
        assert not (tmp_path / "nx").exists()


# ---------------------------------------------------------------- constructor


CONSTRUCTOR_CASES = [
    # (kwargs, exception, text the message holds)
    (dict(staging="lots"), ValueError, '"lots"'),
    (dict(staging="1.5XB"), ValueError, '"1.5XB"'),
    (dict(staging=0), ValueError, "staging=0"),
    (dict(staging=-5), ValueError, "staging=-5"),
    (dict(staging=True), TypeError, "staging=True"),
    (dict(staging=1.5), TypeError, "staging=1.5"),
    (dict(staging="99999999PiB"), ValueError, '"99999999PiB"'),
    (dict(keep=0), ValueError, "keep=0"),
    (dict(keep=-1), ValueError, "keep=-1"),
    (dict(keep=True), ValueError, "keep=True"),
    (dict(keep="3"), ValueError, "keep='3'"),
    (dict(socket=""), ValueError, "socket=''"),
    (dict(log=""), ValueError, "log=''"),
    (dict(log="/"), IsADirectoryError, "Checkpointer(log=...) is a directory"),
    (dict(socket=5), TypeError, "socket=5"),
    (dict(cpus="9-1"), ValueError, '"9-1" is not a CPU list'),
    (dict(cpus=""), ValueError, "cpus=''"),
    (dict(cpus="1,x"), ValueError, '"1,x" is not a CPU list'),
    (dict(cpus=[-1]), ValueError, "cpus=[-1]"),
    (dict(cpus=[True]), ValueError, "cpus=[True]"),
    (dict(cpus=[]), ValueError, "cpus=[]"),
    (dict(cpus=3), TypeError, "cpus=3"),
]


@pytest.mark.parametrize("kwargs,exc,text", CONSTRUCTOR_CASES, ids=[repr(c[0]) for c in CONSTRUCTOR_CASES])
def test_bad_constructor_arguments_raise_before_anything_is_made(kwargs, exc, text, tmp_path, private_tmp,
                                                                 no_default_sidecar):
    before, tmp_before = tree(tmp_path), tree(private_tmp)
    with pytest.raises(exc) as e:
        cs.Checkpointer(dir=str(tmp_path / "ck"), **kwargs)
    assert text in str(e.value), str(e.value)
    assert tree(tmp_path) == before, "the constructor created something"
    assert tree(private_tmp) == tmp_before, "the constructor left a temp folder"
    # Nothing holds the directory: a good Checkpointer starts at once.
    gc.collect()
    ok = cs.Checkpointer(dir=str(tmp_path / "ck"), staging="16MiB")
    try:
        ok.save(1, {"w": np.arange(4)}).wait_durable()
    finally:
        ok.close()
    assert lock_is_free(str(tmp_path / "ck"))


@pytest.mark.parametrize("dir,exc", [("", ValueError), (5, TypeError), (["ck"], TypeError)])
def test_a_directory_that_is_no_path_is_refused_naming_it(dir, exc, tmp_path, private_tmp, no_default_sidecar,
                                                          monkeypatch):
    # "" is no directory: not the current one.
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with pytest.raises(exc) as e:
        cs.Checkpointer(dir=dir, staging="16MiB")
    assert f"dir={dir!r}" in str(e.value), str(e.value)
    assert tree(tmp_path) == {str(cwd)}, "something was made"


def test_a_bytes_directory_is_a_directory(tmp_path, private_tmp, no_default_sidecar):
    ck = cs.Checkpointer(dir=os.fsencode(tmp_path / "ck"), staging="16MiB")
    try:
        assert ck.dir == str(tmp_path / "ck")
        ck.save(1, STATE).wait_durable()
        assert ck.list() == [1]
    finally:
        ck.close()


def test_a_spawned_sidecar_that_fails_to_start_is_said_in_one_line(tmp_path, private_tmp, no_default_sidecar,
                                                                   monkeypatch):
    # Its log says what it does first (INFO lines), then its error: only the
    # error is the exception's message.
    monkeypatch.setenv("CKPT_SIDECAR_LOG", "info")
    with pytest.raises(cs.SidecarError) as e:
        cs.Checkpointer(dir=str(tmp_path / "ck"), staging="15PiB")
    msg = str(e.value)
    assert "\n" not in msg.strip() and " INFO " not in msg and " WARN " not in msg, msg
    assert msg.startswith("spawned sidecar exited with 1: cannot allocate 15.0 PiB of staging memory"), msg
    (tmp_path / "afile").write_bytes(b"precious")
    with pytest.raises(cs.SidecarError) as e:
        cs.Checkpointer(dir=str(tmp_path / "ck"), socket=str(tmp_path / "afile"), staging="16MiB")
    assert str(e.value) == f"spawned sidecar exited with 1: {tmp_path / 'afile'}: exists and is not a socket"
    assert (tmp_path / "afile").read_bytes() == b"precious"


def test_a_second_checkpointer_of_the_same_directory_in_one_process_is_refused_at_once(tmp_path, private_tmp,
                                                                                        no_default_sidecar):
    # It waited 120 s for the first one's lock (as for a draining sidecar).
    import time

    ck = cs.Checkpointer(dir=str(tmp_path / "ck"), staging="16MiB")
    try:
        t0 = time.monotonic()
        with pytest.raises(cs.SidecarError, match="in use by another Checkpointer of this process"):
            cs.Checkpointer(dir=str(tmp_path / "ck" / "." ), staging="16MiB")
        assert time.monotonic() - t0 < 30
        ck.save(1, STATE).wait_durable()
    finally:
        ck.close()
    again = cs.Checkpointer(dir=str(tmp_path / "ck"), staging="16MiB")
    try:
        assert again.list() == [1]
    finally:
        again.close()


def test_options_of_a_spawned_sidecar_given_to_a_running_one_are_said_to_be_ignored(sidecar):
    # keep=2 against a sidecar already running: no retention happens; it was silent.
    with pytest.warns(UserWarning, match=r"keep=2, staging=1073741824: ignored, the sidecar at .* was already running"):
        ck = cs.Checkpointer(socket=sidecar.socket, keep=2, staging="1GiB")
    ck.close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cs.Checkpointer(socket=sidecar.socket).close()


def test_a_file_as_the_directory_is_refused_naming_it(tmp_path, private_tmp, no_default_sidecar):
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    before = tree(tmp_path)
    with pytest.raises(NotADirectoryError) as e:
        cs.Checkpointer(dir=str(f))
    assert str(f) in str(e.value) and "not a directory" in str(e.value)
    assert tree(tmp_path) == before
    with pytest.raises(NotADirectoryError):
        cs.Checkpointer(dir=str(f / "sub"))


# ---------------------------------------------------------------- steps and states


STATE = {"w": np.arange(10, dtype=np.float32)}

SAVE_STEP_CASES = [
    (3.5, TypeError), (-1, ValueError), (True, TypeError), (False, TypeError), ("5", ValueError), (None, TypeError),
    (10**12, ValueError), (2**64 - 1, ValueError), (np.float64(2.0), TypeError),
]


@pytest.mark.parametrize("step,exc", SAVE_STEP_CASES, ids=[repr(c[0]) for c in SAVE_STEP_CASES])
def test_save_takes_only_a_step_that_is_a_non_negative_int(ck, step, exc):
    with pytest.raises(exc) as e:
        ck.save(step, STATE)
    assert repr(step) in str(e.value) and "step" in str(e.value)
    assert ck.list() == [], "a refused step reached the sidecar"


LOAD_STEP_CASES = [(-1, ValueError), (True, TypeError), ("bogus", ValueError), (2.5, TypeError), ("", ValueError)]


@pytest.mark.parametrize("step,exc", LOAD_STEP_CASES, ids=[repr(c[0]) for c in LOAD_STEP_CASES])
def test_load_and_rollback_take_an_int_step_or_latest(ck, step, exc):
    ck.save(1, STATE).wait_durable()
    with pytest.raises(exc) as e:
        ck.load(step)
    assert repr(step) in str(e.value) and '"latest"' in str(e.value)
    with pytest.raises(exc) as e:
        ck.rollback(step)
    assert repr(step) in str(e.value)
    np.testing.assert_array_equal(ck.load("latest")["w"], STATE["w"])
    np.testing.assert_array_equal(ck.load(np.int64(1))["w"], STATE["w"])
    assert ck.list() == [1]


def test_numpy_int_steps_are_steps(ck):
    ck.save(np.uint32(7), STATE).wait_durable()
    assert ck.list() == [7]


def test_states_that_cannot_be_saved_name_where_the_trouble_is(ck):
    with open(os.devnull) as f:
        with pytest.raises(TypeError) as e:
            ck.save(1, {"model": {"w": np.ones(3)}, "extra": [1, {"log": f}]})
    assert "['extra']['1']['log']" in str(e.value) and "pickle" in str(e.value)
    d = {"w": np.ones(2)}
    d["again"] = d
    with pytest.raises(ValueError) as e:
        ck.save(2, d)
    assert "['again']" in str(e.value) and "self-referencing" in str(e.value)
    lst = [np.ones(2)]
    lst.append(lst)
    with pytest.raises(ValueError, match="self-referencing"):
        ck.save(3, {"l": lst})
    assert ck.list() == []
    # A value seen twice (not inside itself) is fine.
    shared = {"a": 1}
    ck.save(4, {"x": shared, "y": shared, "w": np.ones(2)}).wait_durable()
    assert ck.load(4)["y"] == {"a": 1}


def test_an_empty_key_round_trips(ck):
    state = {"": np.zeros(3), "tensor": np.ones(2), "n": {"": np.full(2, 7)}}
    ck.save(1, state).wait_durable()
    back = ck.load(1)
    for k in ("", "tensor"):
        np.testing.assert_array_equal(back[k], state[k])
    np.testing.assert_array_equal(back["n"][""], state["n"][""])


# ---------------------------------------------------------------- closed, forked


def test_a_closed_checkpointer_refuses_everything(ck):
    h = ck.save(1, STATE).wait_durable()
    ck.close()
    # Its save handles too: Closed, not the native shim's "client is NULL".
    for call in (lambda: ck.save(2, STATE), lambda: ck.load(), lambda: ck.list(), lambda: ck.rollback(1),
                 lambda: ck.latest(), lambda: ck.wait_released(), lambda: h.wait_durable(), lambda: h.state(),
                 lambda: h.figures(), lambda: h.done()):
        with pytest.raises(cs.Closed) as e:
            call()
        assert str(e.value) == "the Checkpointer is closed"
    ck.close()  # twice is fine


@pytest.mark.parametrize("timeout,exc", [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError),
                                         (True, TypeError), (float("-inf"), ValueError)])
def test_a_wait_takes_a_timeout_of_seconds_or_none(ck, timeout, exc):
    h = ck.save(1, STATE)
    with pytest.raises(exc) as e:
        h.wait_durable(timeout=timeout)
    assert f"timeout={timeout!r}" in str(e.value)
    # No limit: None, or infinity (not an OverflowError).
    assert h.wait_durable(timeout=float("inf")) is h
    assert h.wait_durable(timeout=1e300) is h
    assert h.wait_durable(timeout=None) is h


def test_a_damaged_checkpoint_is_said_in_one_line(ck, sidecar):
    for s in (1, 2):
        ck.save(s, {"a": np.full(1000, s), "b": np.full(2000, s)}).wait_durable()
    # Step 1: not the one the sidecar still holds in memory (that one loads from RAM).
    d = sidecar.dir / "step-000000000001"
    shard = next(p for p in d.iterdir() if p.name.endswith(".safetensors"))
    os.truncate(shard, 100)
    (d / "blobs" / "structure.pkl").unlink()
    for call in (lambda: ck.load(1), lambda: ck.load_tensors(["a"], step=1)):
        with pytest.raises(cs.Damaged) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg, msg
        assert f"{shard.name}: 100 bytes where the index says" in msg and "structure.pkl" in msg, msg


def test_lazy_conjugate_and_negative_views_are_saved_as_their_values(ck):
    # z.conj() shares z's memory with a flag: its bytes as they lie are z's.
    # They were sent (or memmoved) raw, so the checkpoint held z, not z.conj().
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    state = {"conj": z.conj(), "imag_of_conj": z.conj().imag, "neg": torch.ones(3)._neg_view(),
             "conj_strided": torch.stack([z, z], 1).conj()[:, 0]}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    for step in (1, 2):  # the second save goes through the kept save plan
        ck.save(step, state).wait_durable()
        back = ck.load(step)
        for k, v in state.items():
            assert back[k].resolve_conj().resolve_neg().tolist() == v.resolve_conj().resolve_neg().tolist(), (step, k)
    # Shared in place: copied at save, not sent as the raw shared memory.
    shared = ck.share({"z": torch.tensor([5 + 6j], dtype=torch.complex64), "o": torch.ones(2)})
    view = {"zc": shared["z"].conj(), "neg": shared["o"]._neg_view()}
    ck.save(3, view).wait_durable()
    back = ck.load(3)
    assert back["zc"].resolve_conj().tolist() == [5 - 6j] and back["neg"].resolve_neg().tolist() == [-1.0, -1.0]


def test_a_conjugate_flag_flipped_between_saves_of_the_same_memory_is_seen(ck):
    # z and z.conj() share address, shape, strides and dtype: a save key
    # without the flags reused z's kept plan (bytes sent raw) for z.conj().
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j, 3 - 4j, 5 + 0.5j], dtype=torch.complex64)
    r = torch.tensor([1.0, -2.0, 3.0])
    many = {f"t{i}": torch.full((2,), float(i)) for i in range(3)}  # a container saved in bulk
    plain = {"z": z, "r": r, **many}
    flagged = {"z": z.conj(), "r": r._neg_view(), **{k: v._neg_view() for k, v in many.items()}}
    for step, state in enumerate([plain, flagged, plain, flagged], start=1):
        ck.save(step, state).wait_durable()
        back = ck.load(step)
        for k, v in state.items():
            assert back[k].resolve_conj().resolve_neg().tolist() == v.resolve_conj().resolve_neg().tolist(), (step, k)


def test_quick_keys_of_torch_containers_tell_what_the_plan_depends_on():
    # The bulk key of a container of torch tensors asks some flags only when
    # a dtype calls for them (quantized, complex): each case still refuses
    # a key or tells the states apart.
    torch = pytest.importorskip("torch")
    from ckpt_sidecar._tree import quick_key

    def key(s):
        return quick_key(s)[0]

    base = torch.zeros(8)
    a, b = base[:4], base[4:]
    assert key({"a": a, "b": b}) == key({"a": base[:4], "b": base[4:]})  # fresh views of the same memory
    assert key({"a": a, "b": b}) != key({"a": b, "b": a})
    assert key({"a": a, "b": b}) != key({"a": a.view(2, 2), "b": b})
    assert key({"a": a, "b": b}) != key({"a": a.view(torch.int32), "b": b})
    assert key({"a": a, "b": b}) != key({"a": a, "b": b.clone().requires_grad_()})
    z = torch.zeros(2, dtype=torch.complex64)
    assert quick_key({"z": z.conj(), "y": z}) is None and quick_key({"z": z, "y": z}) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        q = torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)
    assert quick_key({"q": q, "p": q}) is None


def test_a_nested_tensor_is_saved_as_torch_pickles_it(ck):
    # It has no sizes: asking raised torch's "Internal error ... Please file an issue".
    torch = pytest.importorskip("torch")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype API's warning
        nt = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    state = {"nt": nt, "w": torch.ones(2), "more": [nt, torch.zeros(1)]}
    for step in (1, 2):
        ck.save(step, state).wait_durable()
        back = ck.load(step)
        assert [t.tolist() for t in back["nt"].unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]
        assert back["w"].tolist() == [1.0, 1.0] and back["more"][1].tolist() == [0.0]


def test_an_array_subclass_keeps_what_its_bytes_do_not_hold(ck, tmp_path):
    # A masked array was saved as its data alone: the mask was lost, the
    # masked values came back as values (and a record array as a plain one).
    m = np.ma.masked_array([1, 2, 3], mask=[False, True, False])
    mm = np.memmap(tmp_path / "mm", dtype=np.float32, mode="w+", shape=(4,))
    mm[:] = 7
    state = {"masked": m, "rec": np.rec.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]), "memmap": mm, "plain": np.arange(3)}
    for step in (1, 2):
        ck.save(step, state).wait_durable()
        back = ck.load(step)
        assert type(back["masked"]) is np.ma.MaskedArray and back["masked"].mask.tolist() == [False, True, False]
        assert back["masked"].sum() == 4
        assert type(back["rec"]) is np.recarray and back["rec"].a.tolist() == [1]
        np.testing.assert_array_equal(back["memmap"], np.full(4, 7, dtype=np.float32))
        np.testing.assert_array_equal(back["plain"], np.arange(3))


def test_load_tensors_takes_a_list_of_names_not_a_name(ck):
    ck.save(1, {"w": np.arange(3), "wx": np.ones(2)}).wait_durable()
    with pytest.raises(TypeError, match=r"names='w': give a list of tensor names, e.g. \['w'\]"):
        ck.load_tensors("w")
    np.testing.assert_array_equal(ck.load_tensors(["w"])["w"], np.arange(3))


def test_reserve_takes_a_size_or_a_state(ck):
    for bad, exc, text in ((-5, ValueError, "state_or_bytes=-5"), (0, ValueError, "state_or_bytes=0"),
                           ("lots", ValueError, '"lots"'), (True, TypeError, "True")):
        with pytest.raises(exc) as e:
            ck.reserve(bad)
        assert text in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="count=0"):
        ck.reserve(1 << 20, count=0)
    ck.reserve("1MiB")
    ck.reserve({"w": np.ones(1000)})
    ck.save(1, STATE).wait_durable()
    assert ck.list() == [1]


def test_a_forked_child_gets_closed_at_once_and_spawns_nothing(tmp_path, private_tmp, no_default_sidecar):
    ck = cs.Checkpointer(dir=str(tmp_path / "ck"), staging="16MiB")
    try:
        ck.save(1, STATE).wait_durable()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, one byte of verdict
            code = b"?"
            try:
                os.close(r)
                spawned = []
                subprocess.Popen.__init__ = lambda *a, **k: spawned.append(a) or (_ for _ in ()).throw(
                    AssertionError("spawned"))
                try:
                    ck.save(2, STATE)
                    code = b"s"  # saved: wrong
                except cs.Closed as e:
                    code = b"c" if "forked child" in str(e) and not spawned else b"x"
                except BaseException:  # noqa: BLE001
                    code = b"e"
            finally:
                os.write(w, code)
                os._exit(0)
        os.close(w)
        verdict = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert verdict == b"c", verdict
        # The parent's Checkpointer is untouched.
        ck.save(3, STATE).wait_durable()
        assert ck.list() == [1, 3]
    finally:
        ck.close()


def test_a_save_larger_than_the_whole_staging_budget_is_refused_before_any_copy(ck):
    import glob

    def segments():
        return sorted(glob.glob(f"/dev/shm/ckpt-{os.getpid()}-*"))

    before = segments()
    big = {"x": np.zeros(80 << 20, dtype=np.uint8), "y": np.ones(3)}  # the sidecar's budget is 64 MiB
    with pytest.raises(cs.TooLarge) as e:
        ck.save(1, big)
    assert "nothing was copied" in str(e.value) and str((80 << 20) + 24) in str(e.value) and "67108864" in str(e.value)
    assert segments() == before, "a region was made for a save that cannot fit"
    assert ck.list() == []
    ck.save(2, {"y": np.ones(3)}).wait_durable()
    assert ck.list() == [2]


def test_ckpt_sidecar_bin_overrides_the_bundled_binary_and_a_wrong_one_is_named(monkeypatch, tmp_path):
    from ckpt_sidecar import _native

    fake = tmp_path / "my-sidecar"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("CKPT_SIDECAR_BIN", str(fake))
    assert _native.sidecar_binary() == str(fake)
    monkeypatch.setenv("CKPT_SIDECAR_BIN", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="CKPT_SIDECAR_BIN.*missing.*not a file"):
        _native.sidecar_binary()


# ---------------------------------------------------------------- the torch.save hook


@pytest.mark.parametrize("value,why", [("0", "a size must be at least 1 byte"), ("lots", "expected a number")])
def test_the_hook_names_a_bad_staging_variable_as_the_user_wrote_it(value, why, tmp_path, private_tmp):
    # The variable, not the Checkpointer keyword the hook passes it on as
    # when it spawns the CUDA way's sidecar (a process that may hold CUDA
    # tensors: substituted here); the file is written all the same.
    import sys
    import textwrap

    pkg = os.path.dirname(os.path.dirname(cs.__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env.update(CKPT_SIDECAR_SOCKET=str(tmp_path / "nobody.sock"), CKPT_SIDECAR_STAGING=value,
               PYTHONPATH=os.pathsep.join([pkg, env.get("PYTHONPATH", "")]))
    for k in ("CKPT_SIDECAR_LIB", "CKPT_SIDECAR_BIN"):
        if k in os.environ:
            env[k] = os.environ[k]
    code = textwrap.dedent("""
        import torch
        from ckpt_sidecar import _hook
        _hook._cuda_possible = lambda torch: True
        _hook.install()
        torch.save({"t": torch.ones(4)}, "a.pt")
        assert _hook.flush(60)
        print(torch.load("a.pt")["t"].sum().item(), _hook.counts()["in_process"])
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["4.0", "1"], r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f'CKPT_SIDECAR_STAGING "{value}": {why}' in lines[0], r.stderr
    assert "staging=" not in r.stderr, r.stderr
