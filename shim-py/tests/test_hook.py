"""The .pth import hook: inert without CKPT_SIDECAR=1; with it, torch.save goes
through the hook. A fake `torch` (pickle-based save/load) tests the mechanics
without torch; a real-torch test runs when torch is installed."""
import os
import subprocess
import sys
import textwrap

import pytest

FAKE_TORCH = '''
import pickle
def save(obj, f, *a, **k):
    if isinstance(f, (str, bytes)) or hasattr(f, "__fspath__"):
        with open(f, "wb") as fh:
            pickle.dump(obj, fh)
    else:
        pickle.dump(obj, f)
def load(f, *a, **k):
    with open(f, "rb") as fh:
        return pickle.load(fh)
'''


def _run(code, env_extra, tmp_path, fake=True):
    env = {k: v for k, v in os.environ.items() if k != "CKPT_SIDECAR"}
    env.update(env_extra)
    if fake:
        (tmp_path / "fake" / "torch").mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
        env["PYTHONPATH"] = str(tmp_path / "fake")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_pth_is_installed():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    assert any(os.path.exists(os.path.join(d, "ckpt_sidecar_hook.pth")) for d in dirs), dirs


def test_hook_inert_without_env(tmp_path):
    code = """
        import sys
        assert not any(k.startswith("ckpt_sidecar") for k in sys.modules), "package imported at start"
        assert not any(type(f).__name__ == "_TorchFinder" for f in sys.meta_path)
        import torch
        assert not hasattr(torch.save, "_ckpt_sidecar_hook")
        print("inert")
    """
    for env in ({}, {"CKPT_SIDECAR": "0"}, {"CKPT_SIDECAR": ""}):
        r = _run(code, env, tmp_path)
        assert r.returncode == 0 and r.stdout.strip() == "inert", (env, r.stderr)


def test_hook_active_with_env(tmp_path):
    code = """
        import sys
        import torch
        assert torch.save._ckpt_sidecar_hook and torch.load._ckpt_sidecar_hook
        obj = {"a": list(range(1000)), "b": "x"}
        torch.save(obj, "out.pt")
        obj["a"].append(1)          # the snapshot was taken inside torch.save
        assert torch.load("out.pt") == {"a": list(range(1000)), "b": "x"}
        torch.save({"n": 2}, "late.pt")   # still pending at exit: finished before exit
        print("ok")
    """
    r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    import pickle

    assert pickle.loads((tmp_path / "out.pt").read_bytes())["b"] == "x"
    assert pickle.loads((tmp_path / "late.pt").read_bytes()) == {"n": 2}
    assert not [p for p in os.listdir(tmp_path) if "ckpt-tmp" in p]


def test_hook_with_real_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed: the real-torch hook test needs it")
    code = """
        import torch
        assert torch.save._ckpt_sidecar_hook
        sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "h": torch.ones(2, dtype=torch.bfloat16), "step": 3}
        torch.save(sd, "model.pt")
        back = torch.load("model.pt")
        assert torch.equal(back["w"], sd["w"]) and back["step"] == 3
    """
    r = _run(code, {"CKPT_SIDECAR": "1"}, tmp_path, fake=False)
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "model.pt")  # this process: no hook
    assert torch.equal(back["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert back["h"].dtype == torch.bfloat16
