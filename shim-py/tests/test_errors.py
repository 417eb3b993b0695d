"""Every CKPT_E_* status of the C header has its SidecarError subclass."""
import re
from pathlib import Path

import pytest

import ckpt_sidecar as cs
from ckpt_sidecar import errors

HEADER = Path(__file__).resolve().parents[2] / "shim-c" / "include" / "ckpt.h"


def test_every_header_status_has_a_subclass():
    if not HEADER.exists():
        pytest.skip(f"skipped: {HEADER} not here (tests run outside the repository)")
    codes = {name: int(v) for name, v in re.findall(r"#define CKPT_E_(\w+) (-\d+)", HEADER.read_text())}
    assert codes, "no CKPT_E_ codes parsed"
    for name, code in codes.items():
        cls = errors.BY_CODE.get(code)
        assert cls is not None and issubclass(cls, cs.SidecarError) and cls.code == code, name
    assert set(errors.BY_CODE) == set(codes.values())


def test_error_for_carries_code_and_message():
    e = errors.error_for(-4, "sidecar gone: not connected")
    assert isinstance(e, cs.Disconnected) and isinstance(e, cs.SidecarGone) and isinstance(e, ConnectionError)
    assert e.code == -4 and str(e) == "sidecar gone: not connected"
    assert type(errors.error_for(-1234, "")) is cs.SidecarError
    assert isinstance(errors.error_for(-5, "t"), TimeoutError)
