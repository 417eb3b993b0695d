"""Smoke test of `ckpt-sidecar bench compare`: a tiny state, one round, every
method that runs here; checks the JSON document's shape and that the PNG was
written. No timing is asserted (figures are for benchmarks)."""

import json
import subprocess
import sys

import pytest


def test_bench_compare_prints_the_json_document_and_draws_the_png(sidecar_bin, tmp_path):
    pytest.importorskip("torch", reason="bench compare measures torch-based methods: torch not installed")
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (.ci/setup-python.sh installs it)")
    png = tmp_path / "compare.png"
    r = subprocess.run([str(sidecar_bin), "bench", "compare", "--dir", str(tmp_path / "disk"), "--sizes", "2MiB",
                        "--rounds", "1", "--warmup", "0", "--json", "--plot", str(png), "--python", sys.executable],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "round 1/1" in r.stderr  # progress lines while it runs
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    size = 2 << 20
    methods = {row["method"] for row in doc["results"]}
    assert {"sidecar_copied", "sidecar_shared", "torch_save", "torch_save_fsync", "dcp_save",
            "dcp_async_save"} <= methods, methods
    assert "deepspeed_fastpersist" in methods or "deepspeed_fastpersist" in doc["skipped"]
    for row in doc["results"]:
        assert {"method", "size_bytes", "stall_s", "durable_s", "restore_s"} <= set(row), row
        assert row["size_bytes"] == size and row["stall_s"] > 0 and row["restore_s"] > 0, row
        assert row["durable_s"] is None if row["method"] == "torch_save" else row["durable_s"] >= row["stall_s"], row
    assert [lim["size_bytes"] for lim in doc["limits"]] == [size]  # one entry per size
    lim = doc["limits"][0]
    assert {"fio_write_s", "fio_read_s", "memcpy_s"} <= set(lim) and lim["memcpy_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The table is printed too.
    assert "sidecar_shared" in r.stdout.splitlines()[1] or any("sidecar_shared" in line for line in r.stdout.splitlines()[:-1])
