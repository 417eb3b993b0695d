"""Smoke test of `ckpt-sidecar bench tensors`: small counts, the C ABI rows
and two ranks on the one sidecar; checks the JSON document's shape and the
printed rows. No timing is asserted (figures are for benchmarks)."""

import json
import os
import subprocess
import sys


def test_bench_tensors_prints_every_row_and_the_ranks_of_one_sidecar(sidecar_bin, tmp_path):
    r = subprocess.run([str(sidecar_bin), "bench", "tensors", "--dir", str(tmp_path / "disk"), "--counts", "200",
                        "--rounds", "1", "--ranks", "2", "--rank-tensors", "300", "--json"],
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, CKPT_SIDECAR_PYTHON=sys.executable))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert "2 ranks done" in r.stderr  # progress lines while it runs
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    (run,) = doc["runs"]
    assert run["incremental"] is True
    assert set(run["alternate"]["bars"]) == {"released_le_1.5ms", "durable_le_1.5x_one"}
    (row,) = run["rows"]
    assert row["n"] == 200 and row["index_bytes"] > 200 * 100, row
    for k in ("many", "one", "c_abi"):
        f = row[k]
        assert 0 < f["save_s"] <= f["released_s"] and f["durable_after_released_s"] > 0, (k, f)
    assert row["load_many_s"] > 0 and row["load_one_s"] > 0
    rk = run["ranks"]
    assert rk["world_size"] == 2 and rk["tensors_per_rank"] == 300 and len(rk["by_rank"]) == 2, rk
    for f in rk["by_rank"]:
        for k in ("many", "one"):
            assert 0 < f[k]["save_s"] <= f[k]["released_s"] and f[k]["durable_after_released_s"] > 0, (k, f)
    assert "2 ranks, one sidecar, each rank's part 300 x 1 KiB" in r.stdout
    assert "rank 1 300 x 1 KiB" in r.stdout and "rank 0 1 x 300 KiB" in r.stdout
