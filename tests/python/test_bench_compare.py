"""Smoke test of `ckpt-sidecar bench compare`: a tiny state, one round, every
method that runs here; checks the JSON document's shape and that the PNG was
written; and DeepSpeed's FastPersist writer through it where DeepSpeed is
installed. No timing is asserted (figures are for benchmarks).

Timeouts are generous: where DeepSpeed is installed, bench compare loads its
async_io op, a JIT C++ build of minutes on a loaded 2-core machine the first
time (.ci/setup-deepspeed.sh builds it ahead; cached after)."""

import json
import subprocess
import sys

import pytest


def test_bench_compare_prints_the_json_document_and_draws_the_png(sidecar_bin, tmp_path):
    pytest.importorskip("torch", reason="bench compare measures torch-based methods: torch not installed")
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (.ci/setup-test-python.sh installs it)")
    png = tmp_path / "compare.png"
    r = subprocess.run([str(sidecar_bin), "bench", "compare", "--dir", str(tmp_path / "disk"), "--sizes", "2MiB",
                        "--rounds", "1", "--warmup", "0", "--json", "--plot", str(png), "--python", sys.executable],
                       capture_output=True, text=True, timeout=1800)
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


def test_bench_compare_runs_deepspeed_fastpersist_and_restores_the_state(sidecar_bin, tmp_path):
    """bench compare's deepspeed_fastpersist method, alone, at a small size
    whose file ends unaligned (the writer's buffered tail): its row has a
    stall, a durable time (stall == durable: the writer is synchronous) and a
    restore that torch.load read back equal to the saved state (the method
    raises, and bench compare fails, otherwise). Skipped, with the reason,
    where deepspeed is not importable or bench compare could not build its
    async_io op here."""
    pytest.importorskip("torch", reason="bench compare measures torch-based methods: torch not installed")
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"skipped: deepspeed is not importable beside {sys.executable} ({last}); "
                    f"opt-in: .ci/test-deepspeed installs it where it can")
    r = subprocess.run([str(sidecar_bin), "bench", "compare", "--dir", str(tmp_path / "disk"), "--sizes", "3MiB",
                        "--rounds", "2", "--warmup", "1", "--methods", "deepspeed_fastpersist", "--json",
                        "--python", sys.executable],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    if "deepspeed_fastpersist" in doc["skipped"]:
        pytest.skip(f"skipped: bench compare skipped deepspeed_fastpersist: {doc['skipped']['deepspeed_fastpersist']}")
    assert [row["method"] for row in doc["results"]] == ["deepspeed_fastpersist"], doc["results"]
    row = doc["results"][0]
    assert row["size_bytes"] == 3 << 20 and row["rounds"] == 2, row
    assert row["stall_s"] > 0 and row["durable_s"] == row["stall_s"] and row["restore_s"] > 0, row
    assert len(row["samples"]) == 2 and all(s["restore_verified"] is True for s in row["samples"]), row
    assert any(line.startswith("deepspeed_fastpersist") for line in r.stdout.splitlines()[:-1])  # in the table
    # Standard output is the table, then the JSON: DeepSpeed's log lines go to stderr.
    assert r.stdout.splitlines()[0].split()[:2] == ["method", "size"], r.stdout[:2000]


def _compare(args, **kw):
    return subprocess.run([sys.executable, "-m", "ckpt_sidecar.bench_compare", *args], capture_output=True, text=True,
                          timeout=600, **kw)


def test_bench_compare_plot_to_an_unwritable_path_fails_before_the_run_in_one_line(tmp_path, capsys):
    # The whole run went first, then a PIL traceback,
    # and the --json document was lost. The path is checked first.
    pytest.importorskip("torch", reason="bench compare imports torch")
    from ckpt_sidecar.bench_compare import parse_args

    (tmp_path / "a_dir").mkdir()
    for png, why in [(tmp_path / "no" / "such" / "p.png", "no folder"), (tmp_path / "a_dir", "is a directory"),
                     (tmp_path / "p.nosuchformat", "matplotlib writes no .nosuchformat file")]:
        with pytest.raises(SystemExit) as e:
            parse_args(["--dir", str(tmp_path / "disk"), "--json", "--plot", str(png)])
        assert e.value.code == 2
        assert f"--plot {png}: {why}" in capsys.readouterr().err
    r = _compare(["--dir", str(tmp_path / "disk"), "--sizes", "1MiB", "--json", "--plot", "/proc/p.png"])
    assert r.returncode == 2, r.stderr
    assert "--plot /proc/p.png: cannot create a file in /proc" in r.stderr, r.stderr
    assert "round 1/" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "disk").exists()   # nothing was run


def test_bench_compare_a_plot_that_fails_after_the_run_keeps_the_json(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch", reason="bench compare imports torch")
    from ckpt_sidecar import bench_compare

    def broken(doc, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench_compare, "plot", broken)
    png = tmp_path / "p.png"
    with pytest.raises(SystemExit, match="--plot .*p.png: writing the plot failed: OSError"):
        bench_compare.main(["--dir", str(tmp_path / "disk"), "--sizes", "128KiB", "--methods", "torch_save",
                            "--rounds", "1", "--warmup", "0", "--json", "--plot", str(png)])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["method"] for r in doc["results"]] == ["torch_save"]


def test_bench_compare_sizes_mean_what_the_command_line_says(tmp_path):
    # `--sizes 100` measured 128 KiB and printed "0Mi"; the module
    # refused 1.5MiB and 1G, which the command line takes.
    pytest.importorskip("torch", reason="bench compare imports torch")
    from ckpt_sidecar.bench_compare import parse_args

    a = parse_args(["--dir", str(tmp_path), "--sizes", "1.5MiB,1G,2MB,300KiB", "--loop-size", "1.5MiB"])
    assert a.sizes == [3 << 19, 1 << 30, 2_000_000, 300 << 10] and a.loop_size == 3 << 19
    r = _compare(["--dir", str(tmp_path / "disk"), "--sizes", "100"])
    assert r.returncode == 2 and "--sizes: 100 B is below the smallest state this benchmark builds (128.0 KiB" \
        in r.stderr, r.stderr
    r = _compare(["--dir", str(tmp_path / "disk"), "--sizes", "1.5XB"])
    assert r.returncode == 2 and 'unknown unit "xb"' in r.stderr, r.stderr
