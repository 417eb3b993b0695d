"""PyTorch through the Python shim (ckpt_sidecar) against the real sidecar:

- a realistic state (model, AdamW state, LR scheduler, step, config) plus every
  dtype torch has, non-contiguous, zero-size and storage-sharing tensors and
  numpy arrays survives save/load bit for bit;
- examples/python/train.py killed with SIGKILL at 10 seeded random points
  (right after the sidecar's Released, right after save() returns, or mid
  forward pass) and resumed each time ends bit-identical to a run that never
  stopped;
- the import hook (CKPT_SIDECAR=1) on an unmodified torch.save/torch.load
  script, and its file read by plain torch.load in a fresh interpreter (the
  hook writes the file from the trainer's own thread today, see
  shim-py/ckpt_sidecar/_hook.py; no sidecar is involved);
- `.venv/bin/python -c "import ckpt_sidecar, torch"` from the repository root.

Sidecars here are `ckpt-sidecar serve` processes the test starts on sockets of
its own and stops, or sidecars the trainer spawns (on a socket of the test's)
that exit with it, so nothing outlives the test.
"""

import contextlib
import fcntl
import os
import random
import signal
import socket as socketlib
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

# Both are installed into .venv by .ci/setup-python.sh; a missing one is an
# error, not a skip (a run that checks nothing must not look like a pass).
import torch  # noqa: E402
import ckpt_sidecar as cs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "python" / "train.py"
COMPARE = REPO / "examples" / "python" / "compare.py"


def listening(sock):
    with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as c:
        try:
            c.connect(str(sock))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def serve(sidecar_bin, ckdir, sock, *extra):
    """A `ckpt-sidecar serve` on its own socket; stopped (SIGTERM: drain) on exit."""
    env = dict(os.environ, CKPT_SIDECAR_LOG="warn")
    for k in ("CKPT_SIDECAR_URING", "CKPT_SIDECAR_DIRECT", "CKPT_SIDECAR", "CKPT_SIDECAR_SOCKET"):
        env.pop(k, None)
    log = open(Path(str(sock) + ".log"), "w")
    p = subprocess.Popen([str(sidecar_bin), "serve", "--dir", str(ckdir), "--socket", str(sock),
                          "--staging", "256MiB", *map(str, extra)],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        # Listening, not only bound: the socket file exists before listen().
        deadline = time.monotonic() + 60
        while not listening(sock):
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sidecar did not start (rc {p.poll()}): {Path(str(sock) + '.log').read_text()}")
            time.sleep(0.02)
        yield p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def tensor_bits(t):
    """The exact bytes of a tensor's elements, in logical order."""
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} instead of a tensor"
        assert b.dtype == a.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
        assert tuple(b.shape) == tuple(a.shape), f"{path}: shape {tuple(b.shape)} != {tuple(a.shape)}"
        assert tensor_bits(b) == tensor_bits(a), f"{path}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)} instead of an ndarray"
        assert b.dtype == a.dtype and b.shape == a.shape, f"{path}: {b.dtype}{b.shape} != {a.dtype}{a.shape}"
        assert np.ascontiguousarray(b).tobytes() == np.ascontiguousarray(a).tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(b.keys()) == list(a.keys()), f"{path}: keys {list(b)} != {list(a)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(b) is type(a) and len(b) == len(a), f"{path}: {type(b).__name__}[{len(b)}] != {type(a).__name__}[{len(a)}]"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert b == a, f"{path}: {b!r} != {a!r}"


def every_dtype():
    """One tensor per torch dtype this torch can make, with bit patterns that
    exercise the whole element (NaN payloads, negative zero, sign bits)."""
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (6, 40), dtype=torch.uint8, generator=gen)
    out, missing = {}, []
    names = ["float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8",
             "uint16", "uint32", "uint64", "complex64", "complex128", "complex32",
             "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    for name in names:
        dt = getattr(torch, name, None)
        if dt is None:
            missing.append(name)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            size = torch.empty(0, dtype=dt).element_size()
        try:
            out[name] = raw[:, : 40 - 40 % size].clone().view(dt)
        except (RuntimeError, TypeError):
            missing.append(name)
    out["bool"] = raw > 127
    return out, missing


def realistic_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16),
                                torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                                torch.nn.Linear(16, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        x = torch.randint(0, 50, (4, 8))
        model(x).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    dtypes, missing = every_dtype()
    base = torch.arange(24, dtype=torch.float32)
    grid = torch.arange(30, dtype=torch.int64).reshape(5, 6)
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "step": 3,
        "config": {"lr": 1e-3, "layers": [16, 2, 32], "name": "tiny", "flags": (True, None)},
        "dtypes": dtypes,
        "noncontig": {
            "transposed": grid.t(),
            "strided": grid[:, ::2],
            "expanded": torch.arange(3.0).expand(4, 3),
            "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "offset": base[5:17].view(3, 4),
        },
        "zero": {"empty": torch.empty(0), "empty3d": torch.empty(3, 0, 2, dtype=torch.float16),
                 "scalar": torch.tensor(2.5, dtype=torch.float64)},
        # Views that share one storage: each must come back with its own values.
        "views": [base, base[2:10], base.view(4, 6), base.view(4, 6)[:, 1]],
        "numpy": {
            "f32": np.linspace(0, 1, 33, dtype=np.float32),
            "i64": np.arange(-5, 7, dtype=np.int64).reshape(3, 4),
            "u8": np.frombuffer(bytes(range(256)), dtype=np.uint8).copy(),
            "bool": np.array([True, False, True]),
            "f16_noncontig": np.arange(40, dtype=np.float16).reshape(5, 8)[:, ::3],
            "empty": np.zeros((0, 4), dtype=np.float64),
        },
    }
    return state, missing


def test_round_trip_realistic_state_every_dtype(tmp_path, sidecar_bin):
    state, missing = realistic_state()
    print(f"torch {torch.__version__}; dtypes this torch cannot make (not tested): {missing or 'none'}")
    with serve(sidecar_bin, tmp_path / "ck", tmp_path / "s.sock"):
        with cs.Checkpointer(dir=str(tmp_path / "ck"), socket=str(tmp_path / "s.sock"), spawn=False) as ck:
            h = ck.save(3, state)
            h.wait_released(timeout=60)
            # Released: the trainer may change its tensors; the checkpoint must not.
            expected = realistic_state()[0]
            for p in state["model"].values():
                p.add_(1)
            state["views"][0].zero_()
            h.wait_durable(timeout=60)
            assert h.done() and h.step == 3
            assert ck.latest() == 3 and 3 in ck.list()
            got = ck.load(step=3, map_location="cpu")
        assert_same(expected, got)
        # A second connection, and latest: the same state.
        with cs.Checkpointer(dir=str(tmp_path / "ck"), socket=str(tmp_path / "s.sock"), spawn=False) as ck:
            assert_same(expected, ck.load())
    # The optimizer and scheduler take their state back.
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16),
                                torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                                torch.nn.Linear(16, 50))
    model.load_state_dict(got["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(got["optim"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched.load_state_dict(got["sched"])
    assert_same(expected["optim"], opt.state_dict())
    assert sched.get_last_lr() == expected["sched"]["_last_lr"]


def test_shared_module_saved_in_place(tmp_path, sidecar_bin):
    """share(model) and share(optimizer.state): the save copies nothing in the
    trainer, the guarded step waits for the sidecar's copy, and the checkpoint
    holds the values of the save, not of the steps after it."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    with serve(sidecar_bin, tmp_path / "ck", tmp_path / "s.sock"):
        with cs.Checkpointer(dir=str(tmp_path / "ck"), socket=str(tmp_path / "s.sock"), spawn=False) as ck:
            ck.share(model)
            step()
            ck.share(opt.state)
            ck.guard(opt)
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            expected = {"model": {k: v.clone() for k, v in state["model"].items()},
                        "optim": {"state": {i: {k: v.clone() for k, v in st.items()}
                                            for i, st in state["optim"]["state"].items()},
                                  "param_groups": state["optim"]["param_groups"]}}
            h = ck.save(1, state)
            assert h.copied_bytes == 0, f"the trainer copied {h.copied_bytes} bytes of shared tensors"
            step()  # the guard waits for the sidecar's copy before the weights change
            step()
            h.wait_durable(timeout=60)
            got = ck.load(step=1)
    assert_same(expected, got)
    assert not torch.equal(got["model"]["0.weight"], model.state_dict()["0.weight"])


TRAIN_ARGS = ["--steps", "24", "--every", "2", "--d-model", "32", "--heads", "2", "--layers", "2",
              "--seq", "16", "--batch", "4", "--no-compare", "--quiet"]


def run_train(args, check=True, env=None):
    p = subprocess.run([sys.executable, str(TRAIN), *TRAIN_ARGS, *args], capture_output=True, text=True,
                       timeout=120, env=env)
    if check and p.returncode != 0:
        pytest.fail(f"train.py {' '.join(args)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def test_kill_at_random_steps_then_resume_is_bit_identical(tmp_path, sidecar_bin):
    steps = int(TRAIN_ARGS[TRAIN_ARGS.index("--steps") + 1])
    seed = int(os.environ.get("CKPT_TEST_SEED", "20261129"))
    rng = random.Random(seed)
    points = sorted(rng.sample(range(2, steps), 10))
    phases = [rng.choice(["released", "saved", "forward"]) for _ in points]
    print(f"seed {seed}: SIGKILL at steps {list(zip(points, phases))}")

    with serve(sidecar_bin, tmp_path / "ref", tmp_path / "ref.sock"):
        run_train(["--dir", str(tmp_path / "ref"), "--socket", str(tmp_path / "ref.sock"),
                   "--out", str(tmp_path / "ref.pt")])

    ck = tmp_path / "ck"
    resumed_from = []

    def crash(i, k, phase, sock):
        p = run_train(["--dir", str(ck), "--socket", str(sock), "--kill-at", str(k), "--kill-phase", phase]
                      + (["--resume"] if i else []), check=False)
        assert p.returncode == -signal.SIGKILL, f"kill at {k} ({phase}): exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        assert f"killing at step {k}" in p.stdout, p.stdout
        if i:
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("resumed from step")]
            resumed_from.append(int(line[0].split()[3]) if line else 0)

    # The first half as a user runs it: each trainer spawns its own sidecar
    # (on a socket of this test's), which drains and exits when its trainer
    # is killed; the next trainer waits for it (the directory's lock).
    for i in range(5):
        crash(i, points[i], phases[i], tmp_path / "spawn.sock")
    # Wait until the last spawned sidecar has drained and gone.
    fd = os.open(ck / ".ckpt-sidecar-py.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.close(fd)
    # The second half against one long-lived `serve` that outlives the trainers.
    sock = tmp_path / "ck.sock"
    with serve(sidecar_bin, ck, sock):
        for i in range(5, len(points)):
            crash(i, points[i], phases[i], sock)
        p = run_train(["--dir", str(ck), "--socket", str(sock), "--resume", "--out", str(tmp_path / "resumed.pt")])
        print(p.stdout)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("resumed from step")]
        resumed_from.append(int(line[0].split()[3]))
    print(f"resumed from steps {resumed_from}")
    # Every resume started from a checkpoint no later than the kill before it;
    # a kill after a release loses nothing (that step committed), except when
    # the kill step had no checkpoint (odd steps with --every 2).
    for (k, phase), r in zip(zip(points, phases), resumed_from):
        assert r <= k
        if phase == "released" and k % 2 == 0:
            assert r == k, f"killed after step {k} was released, but resumed from {r}"

    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert ref["step"] == got["step"] == steps
    assert_same(ref["model"], got["model"], "model")
    assert_same(ref["optim"], got["optim"], "optim")
    assert_same(ref["sched"], got["sched"], "sched")
    c = subprocess.run([sys.executable, str(COMPARE), str(tmp_path / "ref.pt"), str(tmp_path / "resumed.pt")],
                       capture_output=True, text=True, timeout=60)
    assert c.returncode == 0 and "IDENTICAL" in c.stdout, c.stdout + c.stderr


def test_sigterm_mid_run_checkpoints_the_step_reached_and_resume_is_bit_identical(tmp_path):
    """Preemption: SIGTERM in the middle of a step (train.py --term-at sends it
    to itself in that step's forward pass, so the step is known; the signal
    takes the kernel's path as a scheduler's would). The trainer checkpoints
    the step it reached, exits 0, and a resume from there ends bit-identical
    to a run that never stopped: at a step with no scheduled checkpoint (7,
    with --every 2) and at one with (8)."""
    sock = str(tmp_path / "spawn.sock")  # each run spawns its sidecar here; it exits with the run
    small = ["--staging", "64MiB"]
    run_train(["--dir", str(tmp_path / "ref"), "--socket", sock, "--out", str(tmp_path / "ref.pt")] + small)
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    for k in (7, 8):
        ck = tmp_path / f"ck{k}"
        p = run_train(["--dir", str(ck), "--socket", sock, "--term-at", str(k)] + small, check=False)
        assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
        assert f"preempted (SIGTERM) at step {k}: checkpoint of step {k} committed" in p.stdout, p.stdout
        assert "done:" not in p.stdout, p.stdout
        assert (ck / "latest").read_text().strip() == f"step-{k:012d}"
        out = tmp_path / f"resumed{k}.pt"
        p = run_train(["--dir", str(ck), "--socket", sock, "--resume", "--out", str(out)] + small)
        assert f"resumed from step {k} " in p.stdout, p.stdout
        got = torch.load(out, weights_only=False)
        assert got["step"] == ref["step"]
        for part in ("model", "optim", "sched"):
            assert_same(ref[part], got[part], part)
        c = subprocess.run([sys.executable, str(COMPARE), str(tmp_path / "ref.pt"), str(out)],
                           capture_output=True, text=True, timeout=60)
        assert c.returncode == 0 and "IDENTICAL" in c.stdout, c.stdout + c.stderr


HOOK_SCRIPT = r"""
import sys, torch
torch.manual_seed(3)
model = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
opt.step()
obj = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 5, "note": "unmodified",
       "half": torch.arange(6, dtype=torch.float16).view(2, 3).t()}
torch.save(obj, sys.argv[1])
back = torch.load(sys.argv[1], weights_only=False)
assert back["epoch"] == 5 and back["note"] == "unmodified"
for k, v in obj["model"].items():
    assert torch.equal(back["model"][k], v), k
assert torch.equal(back["half"], obj["half"])
print("hooked" if "ckpt_sidecar._hook" in sys.modules else "not hooked")
"""

READ_SCRIPT = r"""
import sys, torch
assert "ckpt_sidecar" not in sys.modules
torch.manual_seed(3)
model = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 8)).sum().backward()
opt.step()
back = torch.load(sys.argv[1], weights_only=False)
assert back["epoch"] == 5 and back["note"] == "unmodified", back
for k, v in model.state_dict().items():
    assert torch.equal(back["model"][k], v), k
st = opt.state_dict()["state"]
for i, s in st.items():
    for k, v in s.items():
        assert torch.equal(back["optim"]["state"][i][k], v), (i, k)
assert torch.equal(back["half"], torch.arange(6, dtype=torch.float16).view(2, 3).t())
assert "ckpt_sidecar" not in sys.modules
print("plain torch.load ok")
"""


def test_import_hook_unmodified_script_and_plain_torch_load(tmp_path):
    script = tmp_path / "unmodified.py"
    script.write_text(HOOK_SCRIPT)
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    p = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                       timeout=120, env=dict(env, CKPT_SIDECAR="1"), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "hooked" in p.stdout and "not hooked" not in p.stdout, p.stdout + p.stderr
    assert out.is_file()
    assert not [f for f in out.parent.iterdir() if f.name != "model.pt"], list(out.parent.iterdir())
    # A fresh interpreter without the hook reads it with plain torch.load.
    reader = tmp_path / "reader.py"
    reader.write_text(READ_SCRIPT)
    p = subprocess.run([sys.executable, str(reader), str(out)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "plain torch.load ok" in p.stdout, p.stdout + p.stderr

    # Without the variable the package changes nothing.
    out2 = tmp_path / "plain.pt"
    p = subprocess.run([sys.executable, str(script), str(out2)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0 and "not hooked" in p.stdout, p.stdout + p.stderr


def test_repo_venv_imports_ckpt_sidecar_and_torch():
    py = REPO / ".venv" / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py}: no repo venv; run `bash .ci/setup-python.sh`")
    p = subprocess.run([str(py), "-c", "import ckpt_sidecar, torch; print(torch.__version__)"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
