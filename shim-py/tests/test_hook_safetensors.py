"""safetensors.torch.save_file / save_model through the torch.save hook
(CKPT_SIDECAR=1, _hook_safetensors): the file is in place when the call
returns, its bytes are safetensors' own, a SIGKILL after the call returned
loses nothing, and what safetensors cannot write fails as safetensors fails."""
import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: the safetensors hook needs it")
st = pytest.importorskip("safetensors.torch", reason="safetensors not installed")


def _run(code, env_extra, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _state():
    return {"w": torch.arange(1000.0), "b": torch.ones(3, 5, dtype=torch.bfloat16),
            "i": torch.arange(7, dtype=torch.int64)}


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 3)
        self.b = self.a  # shared weights: save_model drops the duplicate names, into the metadata


def test_safetensors_save_file_and_save_model_are_placed_at_return_with_safetensors_own_bytes(tmp_path, sidecar):
    code = """
        import torch, safetensors.torch
        from ckpt_sidecar import _hook, _hook_safetensors
        from safetensors.torch import save_file   # imported by name, as libraries do
        assert save_file._ckpt_sidecar_hook
        save_file({"w": torch.arange(1000.), "b": torch.ones(3, 5, dtype=torch.bfloat16),
                   "i": torch.arange(7, dtype=torch.int64)}, "p.safetensors", metadata={"k": "v"})
        import test_model
        safetensors.torch.save_model(test_model._Tiny(), "m.safetensors", metadata={"format": "pt"})
        assert safetensors.torch.load_file("m.safetensors")["a.weight"].shape == (3, 4)
        _hook.flush()
        print(_hook.counts())
        print(_hook_safetensors.counts())
    """
    (tmp_path / "test_model.py").write_text("import torch\n" + textwrap.dedent('''
        class _Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.a = torch.nn.Linear(4, 3)
                self.b = self.a
    '''))
    r = _run(code, {"CKPT_SIDECAR": "1", "CKPT_SIDECAR_SOCKET": sidecar.socket, "PYTHONPATH": str(tmp_path)},
             tmp_path)
    assert r.returncode == 0, r.stderr
    hook, ours = (ast.literal_eval(x) for x in r.stdout.strip().splitlines()[-2:])
    assert hook == {"sidecar": 0, "in_process": 2, "superseded": 0}, r.stdout
    assert ours == {"hooked": 2, "original": 0}, r.stdout
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n], os.listdir(tmp_path)
    # This process has no hook: safetensors' own writes, byte for byte.
    st.save_file(_state(), tmp_path / "q.safetensors", metadata={"k": "v"})
    assert (tmp_path / "p.safetensors").read_bytes() == (tmp_path / "q.safetensors").read_bytes()
    # save_model's metadata has several keys (the dropped names too), which
    # safetensors itself writes in a random order (a Rust HashMap): the same
    # header, lengths and tensor bytes, in whatever order its serialiser chose.
    st.save_model(_Tiny(), tmp_path / "n.safetensors", metadata={"format": "pt"})
    assert _parts(tmp_path / "m.safetensors") == _parts(tmp_path / "n.safetensors")


def test_safetensors_sigkill_right_after_save_file_returns_keeps_the_file(tmp_path, sidecar):
    code = """
        import os, torch
        from safetensors.torch import save_file
        save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, "big.safetensors", metadata={"k": "v"})
        os.kill(os.getpid(), 9)
    """
    r = _run(code, {"CKPT_SIDECAR": "1", "CKPT_SIDECAR_SOCKET": sidecar.socket}, tmp_path)
    assert r.returncode == -9, r.stderr
    # In place before save_file returned; no temp file left.
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n], os.listdir(tmp_path)
    st.save_file({"w": torch.arange(1 << 20, dtype=torch.float32)}, tmp_path / "own.safetensors", metadata={"k": "v"})
    assert (tmp_path / "big.safetensors").read_bytes() == (tmp_path / "own.safetensors").read_bytes()


def _parts(path):
    """(header length, header as JSON, the bytes after it) of a safetensors file."""
    import json
    import struct

    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return n, json.loads(b[8:8 + n]), b[8 + n:]


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error itself is compared
        return type(e).__module__, type(e).__name__, str(e)
    return None


def test_safetensors_unwritable_path_raises_safetensors_own_error(tmp_path, sidecar):
    (tmp_path / "a_dir.safetensors").mkdir()
    cases = ["no/such/dir/x.safetensors", "a_dir.safetensors", "/proc/x.safetensors"]
    code = f"""
        import torch
        from safetensors.torch import save_file
        from ckpt_sidecar import _hook_safetensors
        for p in {cases!r}:
            try:
                save_file({{"w": torch.arange(10.)}}, p)
                print(repr(None))
            except Exception as e:
                print(repr((type(e).__module__, type(e).__name__, str(e))))
        print(_hook_safetensors.counts())
    """
    r = _run(code, {"CKPT_SIDECAR": "1", "CKPT_SIDECAR_SOCKET": sidecar.socket}, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        own = [_error_of(lambda p=p: st.save_file({"w": torch.arange(10.0)}, p)) for p in cases]
    finally:
        os.chdir(cwd)
    assert all(e is not None for e in own), own
    # safetensors (0.8) writes through a temp file of a random name, which its message names.
    tmp = re.compile(r"[.]tmp[A-Za-z0-9]{6}")
    norm = [tuple(tmp.sub(".tmpXXXXXX", part) for part in e) for e in own]
    assert [tuple(tmp.sub(".tmpXXXXXX", part) for part in ast.literal_eval(x)) for x in lines[:-1]] == norm
    assert ast.literal_eval(lines[-1]) == {"hooked": 0, "original": len(cases)}


def test_safetensors_what_safetensors_refuses_is_refused_at_call_time(tmp_path, sidecar):
    # A non-contiguous tensor: safetensors' serialiser refuses it, before
    # anything is sent or written.
    code = """
        import torch
        from safetensors.torch import save_file
        try:
            save_file({"w": torch.arange(12.).reshape(3, 4).t()}, "x.safetensors")
            print("no error")
        except ValueError as e:
            print("ValueError", "non contiguous" in str(e))
    """
    r = _run(code, {"CKPT_SIDECAR": "1", "CKPT_SIDECAR_SOCKET": sidecar.socket}, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ValueError True", r.stdout + r.stderr
    assert not (tmp_path / "x.safetensors").exists()
