"""packaging/build-wheel.sh: a manylinux wheel that installs with no Rust
toolchain (`pip install --no-index --no-deps` into a new venv whose PATH
holds no cargo) and puts a `ckpt-sidecar` command on the venv's PATH that
runs the bundled binary with that venv's Python."""
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_installs_without_cargo_and_ckpt_sidecar_runs_from_the_venv(tmp_path):
    # Packs the binaries the suite tests (.ci/test builds them first): a cargo
    # build of two packages alone unifies features apart from the workspace's
    # and would build both crates again, a minute on the CI machine.
    env = dict(os.environ, PYTHON=sys.executable, CKPT_SIDECAR_SKIP_CARGO="1")
    r = subprocess.run(["bash", str(REPO / "packaging" / "build-wheel.sh"), str(tmp_path / "wheels")], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = Path(r.stdout.strip().splitlines()[-1])  # its path: the last line
    assert wheel.is_file() and wheel.parent == tmp_path / "wheels"
    assert re.fullmatch(r"ckpt_sidecar-[\d.]+-py3-none-manylinux_2_\d+_(x86_64|aarch64)\.whl", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckpt_sidecar/_native/ckpt-sidecar" in names and "ckpt_sidecar/_native/libckpt.so" in names, names
    assert "ckpt_sidecar_hook.pth" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    clean = {"HOME": str(tmp_path), "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    assert subprocess.run(["bash", "-c", "command -v cargo"], env=clean).returncode != 0, "cargo on the clean PATH"
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-index", "--no-deps", str(wheel)], env=clean, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    # numpy for bench ranks (--no-deps installs none): this test's, through a
    # .pth made after the install (its folder may hold another ckpt_sidecar,
    # which pip would take as installed; the venv's own comes first on sys.path).
    import numpy

    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-numpy.pth").write_text(str(Path(numpy.__file__).parents[1]) + "\n")
    cmd = venv / "bin" / "ckpt-sidecar"
    r = subprocess.run([str(cmd), "--version"], env=clean, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ckpt-sidecar "), r.stdout + r.stderr
    r = subprocess.run(["ckpt-sidecar", "bench", "compare", "--help"], env=clean, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "Usage: ckpt-sidecar bench compare" in r.stdout, r.stdout + r.stderr
    # bench ranks runs Python: the venv's own (its ckpt_sidecar), with no $CKPT_SIDECAR_PYTHON set.
    r = subprocess.run(["ckpt-sidecar", "bench", "ranks", "--help"], env=clean, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--ranks" in r.stdout, r.stdout + r.stderr
