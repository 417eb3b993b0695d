"""The `ckpt-sidecar` console command a pip install puts on the venv's PATH:
runs the bundled binary (ckpt_sidecar/_native/ckpt-sidecar, or
$CKPT_SIDECAR_BIN) with this venv's Python for its Python-backed
subcommands (`bench compare`, `bench ranks`: $CKPT_SIDECAR_PYTHON, unless
set already). The binary replaces this process (exec): signals, exit
status and stdin/stdout are the binary's own."""

import os
import sys


def main():
    from ._native import NATIVE_DIR

    # Not _native.sidecar_binary(): its last resort, PATH, would find this very command.
    binary = os.environ.get("CKPT_SIDECAR_BIN") or str(NATIVE_DIR / "ckpt-sidecar")
    os.environ.setdefault("CKPT_SIDECAR_PYTHON", sys.executable)
    try:
        os.execv(binary, [binary] + sys.argv[1:])
    except OSError as e:
        print(f"ckpt-sidecar: cannot run {binary}: {e}", file=sys.stderr)
        return 1
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
