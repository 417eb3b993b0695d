"""Build step: cargo builds the native shim and the sidecar, and both go into
the package (ckpt_sidecar/_native/), together with the import hook's .pth file.

The repository root is this file's parent's parent (pip >= 21.3 builds in
place); CKPT_SIDECAR_REPO overrides it, CARGO_TARGET_DIR is honoured, and
CKPT_SIDECAR_SKIP_CARGO=1 reuses what target/release already holds.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
PTH_NAME = "ckpt_sidecar_hook.pth"
NATIVE_FILES = ("libckpt.so", "ckpt-sidecar")


def _cargo() -> str:
    found = shutil.which("cargo")
    if found:
        return found
    home_cargo = Path.home() / ".cargo" / "bin" / "cargo"
    if home_cargo.exists():
        return str(home_cargo)
    raise RuntimeError("cargo not found: install Rust (rustup) to build ckpt-sidecar's native shim")


class BuildWithNative(build_py):
    def run(self):
        super().run()
        repo = Path(os.environ.get("CKPT_SIDECAR_REPO", HERE.parent)).resolve()
        target = Path(os.environ.get("CARGO_TARGET_DIR", repo / "target"))
        if not target.is_absolute():
            target = repo / target
        if os.environ.get("CKPT_SIDECAR_SKIP_CARGO") != "1":
            cmd = [_cargo(), "build", "--release", "-p", "ckpt-shim", "-p", "ckpt-sidecar"]
            self.announce("running " + " ".join(cmd), level=2)
            subprocess.check_call(cmd, cwd=repo)
        native = Path(self.build_lib) / "ckpt_sidecar" / "_native"
        native.mkdir(parents=True, exist_ok=True)
        for name in NATIVE_FILES:
            src = target / "release" / name
            if not src.exists():
                raise RuntimeError(f"{src} missing after the cargo build")
            shutil.copy2(src, native / name)
        # The .pth goes to site-packages' root; it does nothing unless CKPT_SIDECAR=1.
        shutil.copy2(HERE / PTH_NAME, Path(self.build_lib) / PTH_NAME)


class BinaryDistribution(Distribution):
    """The wheel carries a native library and binary: tag it per platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithNative}, distclass=BinaryDistribution)
