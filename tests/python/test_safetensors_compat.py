"""Checkpoints written by ckpt-sidecar load with the official `safetensors`
library, byte for byte.

For several configurations (one or two target directories, big or tiny
shards, each I/O engine forced) the test makes random arrays of every dtype,
writes them as raw files plus a manifest, commits them with the hidden
`ckpt-sidecar debug write-raw` command, and then reads every shard back with
`safetensors.deserialize`, `safetensors.safe_open(framework="numpy")` and
`safetensors.numpy.load_file`, comparing names, dtypes, shapes and bytes with
the originals. The index (model.safetensors.index.json) is checked against the
shards: weight_map, offsets, sizes and CRC-32C of every tensor and file.

numpy has no bfloat16 or float8: those tensors are made as raw uint16/uint8
bytes, declared BF16/F8_* in the manifest, and compared as bytes through
`safetensors.deserialize` (which returns raw bytes for every dtype); numpy's
loaders are used on the dtypes numpy has.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np
import pytest
import safetensors
import safetensors.numpy

INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"rank-\d+-of-\d+-shard-\d+\.safetensors")

# safetensors dtype -> the numpy dtype safetensors' numpy loaders return.
NATIVE = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "U64": np.uint64,
}
# Dtypes numpy lacks: made as raw bytes of this numpy type.
RAW = {"BF16": np.uint16, "F8_E5M2": np.uint8, "F8_E4M3": np.uint8}

assert sys.byteorder == "little", "safetensors is little-endian; these tests compare native bytes"


# ---------------------------------------------------------------- test data


@dataclass
class Tensor:
    name: str
    dtype: str  # safetensors spelling
    shape: list
    array: np.ndarray  # for BF16/F8: the raw uint16/uint8 bits

    @property
    def data(self) -> bytes:
        return self.array.tobytes()


def random_array(rng: np.random.Generator, dtype: str, shape: list) -> np.ndarray:
    shape = tuple(shape)
    if dtype == "BOOL":
        a = rng.integers(0, 2, size=shape).astype(np.bool_)
    elif dtype == "BF16":  # the top half of float32 normals
        f = np.asarray(rng.standard_normal(shape), dtype=np.float32)
        a = (f.view(np.uint32) >> 16).astype(np.uint16)
    elif dtype in RAW:  # float8: any byte is a valid pattern
        a = rng.integers(0, 256, size=shape, dtype=np.uint8)
    else:
        npd = np.dtype(NATIVE[dtype])
        if npd.kind == "f":
            a = np.asarray(rng.standard_normal(shape) * 100, dtype=npd)
            if a.size >= 4:
                a.flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
        else:
            info = np.iinfo(npd)
            a = rng.integers(info.min, info.max, size=shape, dtype=npd, endpoint=True)
    a = np.ascontiguousarray(np.asarray(a).reshape(shape))
    assert a.nbytes == int(np.prod(shape, dtype=np.int64)) * a.itemsize
    return a


def make_tensors(seed: int, numpy_only: bool) -> list:
    """Every dtype in several shapes, plus the awkward cases."""
    rng = np.random.default_rng(seed)
    dtypes = list(NATIVE) + ([] if numpy_only else list(RAW))
    specs = []
    for d in dtypes:
        specs += [
            (f"model.layers.0.mlp.{d.lower()}.weight", d, [3, 7]),  # 21 elements: odd bytes for 1-byte dtypes
            (f"scalars.{d}", d, []),
            (f"empty.{d}", d, [0]),
        ]
    # Medium tensors, so that a small --shard-size makes many shards.
    medium = ["F32", "F16", "I32", "U8"] if numpy_only else ["F32", "BF16", "F16", "F8_E4M3"]
    for i in range(12):
        specs.append((f"model.layers.{i}.self_attn.q_proj.weight", medium[i % 4], [96, 251]))
    specs += [
        ("empty.3d", "F32", [4, 0, 3]),
        ("odd.u8", "U8", [13]),
        ("odd.bool", "BOOL", [5, 1]),
        ("odd.i8", "I8", [1, 3, 3]),
        ("odd.i16", "I16", [3]),
        ("odd.f16.3d", "F16", [3, 5, 1]),
        ("model.embed_tokens.weight", "F32", [1031, 1024]),  # ~4 MiB
        ("模型.层.0.权重", "F16", [4, 4]),
        ("émbed.ñ.🙂", "I32", [3]),
        ('quote"and\\backslash', "U8", [3]),
        ("with space/and slash", "F64", [2]),
        ("a." * 300 + "long", "I64", [2]),
    ]
    if not numpy_only:
        specs += [
            ("lm_head.weight", "BF16", [512, 1023]),  # ~1 MiB
            ("odd.f8_e5m2", "F8_E5M2", [5, 3]),
            ("odd.f8_e4m3.scalar", "F8_E4M3", []),
        ]
    return [Tensor(n, d, s, random_array(rng, d, s)) for n, d, s in specs]


def make_blobs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "optimizer.state": rng.bytes((1 << 20) + 3),
        "rng_state-0.bin": rng.bytes(17),
        "empty.blob": b"",
    }


def write_manifest(src: Path, tensors: list, blobs: dict) -> Path:
    src.mkdir(parents=True)
    manifest = {"tensors": [], "blobs": []}
    for i, t in enumerate(tensors):
        (src / f"t{i:04}.bin").write_bytes(t.data)
        manifest["tensors"].append({"name": t.name, "dtype": t.dtype, "shape": t.shape, "file": f"t{i:04}.bin"})
    for i, (name, data) in enumerate(blobs.items()):
        (src / f"b{i:04}.bin").write_bytes(data)
        manifest["blobs"].append({"name": name, "file": f"b{i:04}.bin"})
    path = src / "manifest.json"
    path.write_text(json.dumps(manifest, ensure_ascii=False), encoding="utf-8")
    return path


# ------------------------------------------------------- reading checkpoints


def header_of(raw: bytes) -> dict:
    """The shard's JSON header, parsed here only to compare data_offsets with the index."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n].decode("utf-8"))


@dataclass
class Checkpoint:
    index: dict
    shards: dict  # file name -> path
    tensors: dict = field(default_factory=dict)  # name -> {"dtype","shape","data","file"}


def read_checkpoint(dirs: list, step: int) -> Checkpoint:
    """Reads a committed checkpoint with safetensors.deserialize and checks
    that the index agrees with the shards on disk."""
    step_name = f"step-{step:012d}"
    index = json.loads((dirs[0] / step_name / INDEX).read_text(encoding="utf-8"))
    assert {"metadata", "weight_map", "ckpt"} <= index.keys()
    ck = index["ckpt"]
    assert ck["format_version"] == 1
    assert ck["step"] == step
    assert ck["world_size"] == 1
    assert [os.path.realpath(p) for p in ck["secondary_dirs"]] == [os.path.realpath(d) for d in dirs[1:]]
    for d in dirs[1:]:
        assert not (d / step_name / INDEX).exists(), "the index belongs in the primary directory only"

    # The shard files on disk are exactly the ones the index lists, each in its directory.
    shards = {}
    for f in ck["files"]:
        assert SHARD_RE.fullmatch(f["name"]), f["name"]
        assert f["name"] not in shards, f"{f['name']} listed twice"
        shards[f["name"]] = dirs[f["dir_idx"]] / step_name / f["name"]
    on_disk = sorted(p for d in dirs for p in (d / step_name).glob("rank-*-shard-*.safetensors"))
    assert on_disk == sorted(shards.values())
    assert {f["dir_idx"] for f in ck["files"]} == set(range(len(dirs))), "every directory gets shards"

    cp = Checkpoint(index, shards)
    for f in ck["files"]:
        raw = shards[f["name"]].read_bytes()
        assert len(raw) == f["len_bytes"], f["name"]
        assert crc32c.crc32c(raw) == f["crc32c"], f"{f['name']}: file CRC-32C differs from the index"
        header = header_of(raw)
        loaded = safetensors.deserialize(raw)
        assert {n for n, _ in loaded} == set(header) - {"__metadata__"}
        for name, t in loaded:
            assert name not in cp.tensors, f"{name} is in two shards"
            cp.tensors[name] = {
                "dtype": t["dtype"],
                "shape": list(t["shape"]),
                "data": bytes(t["data"]),
                "file": f["name"],
                "data_offsets": list(header[name]["data_offsets"]),
            }

    # The index's tables agree with what the shards hold.
    assert index["weight_map"] == {n: t["file"] for n, t in cp.tensors.items()}
    assert set(ck["tensors"]) == set(cp.tensors)
    for name, t in cp.tensors.items():
        e = ck["tensors"][name]
        assert e["file"] == t["file"], name
        assert e["dtype"] == t["dtype"], name
        assert list(e["shape"]) == t["shape"], name
        assert list(e["data_offsets"]) == t["data_offsets"], name
        assert e["crc32c"] == crc32c.crc32c(t["data"]), f"{name}: tensor CRC-32C differs from the index"
    assert index["metadata"]["total_size"] == sum(len(t["data"]) for t in cp.tensors.values())
    return cp


def check_numpy_loaders(cp: Checkpoint) -> int:
    """Loads every shard with safe_open(framework="numpy") and, where numpy
    has all its dtypes, safetensors.numpy.load_file; compares with what
    deserialize returned. Returns how many shards load_file loaded."""
    whole = 0
    for fname, path in cp.shards.items():
        mine = {n: t for n, t in cp.tensors.items() if t["file"] == fname}
        with safetensors.safe_open(str(path), framework="numpy") as f:
            assert set(f.keys()) == set(mine)
            for name, t in mine.items():
                sl = f.get_slice(name)
                assert sl.get_dtype() == t["dtype"], name
                assert list(sl.get_shape()) == t["shape"], name
                if t["dtype"] not in NATIVE:
                    continue  # numpy has no bfloat16 / float8
                arr = f.get_tensor(name)
                assert arr.dtype == np.dtype(NATIVE[t["dtype"]]), name
                assert list(arr.shape) == t["shape"], name
                assert arr.tobytes() == t["data"], name
                if arr.ndim >= 1 and arr.shape[0] > 1:  # a partial read
                    assert sl[1:].tobytes() == arr[1:].tobytes(), name
        if all(t["dtype"] in NATIVE for t in mine.values()):
            loaded = safetensors.numpy.load_file(str(path))
            assert set(loaded) == set(mine)
            for name, arr in loaded.items():
                assert arr.dtype == np.dtype(NATIVE[mine[name]["dtype"]]), name
                assert list(arr.shape) == mine[name]["shape"], name
                assert arr.tobytes() == mine[name]["data"], name
            whole += 1
    return whole


def check_blobs(dirs: list, step: int, cp: Checkpoint, blobs: dict) -> None:
    step_name = f"step-{step:012d}"
    bdir = dirs[0] / step_name / "blobs"
    on_disk = sorted(p.name for p in bdir.iterdir()) if bdir.exists() else []
    assert on_disk == sorted(blobs)
    for name, data in blobs.items():
        assert (bdir / name).read_bytes() == data, name
    listed = {b["name"]: b for b in cp.index["ckpt"]["blobs"]}
    assert set(listed) == set(blobs)
    for name, data in blobs.items():
        assert listed[name]["len_bytes"] == len(data), name
        assert listed[name]["crc32c"] == crc32c.crc32c(data), name
    for d in dirs[1:]:
        assert not (d / step_name / "blobs").exists(), "blobs belong in the primary directory only"


# ---------------------------------------------------------------------- tests


@dataclass
class Config:
    id: str
    n_dirs: int = 1
    shard_size: str | None = None  # --shard-size; None: the default (1 GiB)
    env: dict = field(default_factory=dict)
    args: list = field(default_factory=list)
    min_shards: int = 1

    def engine_ok(self, engine: str) -> bool:
        want = {**self.env}
        for flag, var in (("--uring", "CKPT_SIDECAR_URING"), ("--direct", "CKPT_SIDECAR_DIRECT")):
            if flag in self.args:
                want[var] = self.args[self.args.index(flag) + 1]
        if want.get("CKPT_SIDECAR_URING") == "off" and ("io_uring" in engine or "thread-pool" not in engine):
            return False
        if want.get("CKPT_SIDECAR_DIRECT") == "off" and ("O_DIRECT" in engine or "buffered" not in engine):
            return False
        return True


OFF = {"CKPT_SIDECAR_URING": "off", "CKPT_SIDECAR_DIRECT": "off"}
CONFIGS = [
    Config("one-dir"),
    Config("two-dirs", n_dirs=2, min_shards=2),
    Config("many-shards", shard_size="64KiB", min_shards=8),
    Config("shard-per-tensor", shard_size="1", min_shards=40),
    Config("two-dirs-many-shards", n_dirs=2, shard_size="64KiB", min_shards=8),
    Config("uring-off", env={"CKPT_SIDECAR_URING": "off"}),
    Config("direct-off", env={"CKPT_SIDECAR_DIRECT": "off"}),
    Config("both-off-two-dirs-many-shards", n_dirs=2, shard_size="64KiB", env=OFF, min_shards=8),
    Config("both-off-by-flags", args=["--uring", "off", "--direct", "off"]),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
def test_write_raw_loads_with_safetensors(cfg, tmp_path, run_sidecar):
    dirs = [tmp_path / "primary"] + [tmp_path / f"secondary{i}" for i in range(1, cfg.n_dirs)]
    # Step 1 holds every dtype; step 2 only numpy's, so load_file must load all its shards.
    for step, numpy_only in ((1, False), (2, True)):
        tensors = make_tensors(seed=step, numpy_only=numpy_only)
        blobs = make_blobs(seed=100 + step)
        manifest = write_manifest(tmp_path / f"src{step}", tensors, blobs)

        args = ["debug", "write-raw", manifest, "--step", step]
        for d in dirs:
            args += ["--dir", d]
        if cfg.shard_size:
            args += ["--shard-size", cfg.shard_size]
        out = json.loads(run_sidecar(*args, *cfg.args, env=cfg.env))
        assert out["step"] == step
        assert os.path.realpath(out["path"]) == os.path.realpath(dirs[0] / f"step-{step:012d}")
        assert cfg.engine_ok(out["engine"]), f"engine {out['engine']!r} ignores {cfg.env or cfg.args}"

        cp = read_checkpoint(dirs, step)
        assert len(cp.shards) >= cfg.min_shards

        # Exactly the manifest's tensors, with their dtype, shape and bytes.
        assert set(cp.tensors) == {t.name for t in tensors}
        for t in tensors:
            got = cp.tensors[t.name]
            assert got["dtype"] == t.dtype, t.name
            assert got["shape"] == t.shape, t.name
            assert got["data"] == t.data, t.name

        whole = check_numpy_loaders(cp)
        if numpy_only:
            assert whole == len(cp.shards)
        check_blobs(dirs, step, cp, blobs)

    # Writing step 2 left step 1 alone.
    cp1 = read_checkpoint(dirs, 1)
    assert {n: t["data"] for n, t in cp1.tensors.items()} == {t.name: t.data for t in make_tensors(1, False)}


BENCH = [("one-dir", 1, None), ("two-dirs-4MiB-shards", 2, "4MiB")]


@pytest.mark.parametrize("n_dirs,shard_size", [b[1:] for b in BENCH], ids=[b[0] for b in BENCH])
def test_bench_write_loads_with_safetensors(n_dirs, shard_size, tmp_path, run_sidecar):
    dirs = [tmp_path / "primary"] + [tmp_path / f"secondary{i}" for i in range(1, n_dirs)]
    args = ["bench", "write", "--size", "32MiB", "--json"]
    for d in dirs:
        args += ["--dir", d]
    if shard_size:
        args += ["--shard-size", shard_size]
    stdout = run_sidecar(*args)
    # `--json` prints the figures as one JSON object on the last line.
    figures = json.loads([line for line in stdout.splitlines() if line.strip()][-1])

    cp = read_checkpoint(dirs, figures["step"])  # every tensor deserializes, CRCs match the index
    check_numpy_loaders(cp)  # and the numpy dtypes load through safe_open too
    assert len(cp.tensors) == figures["n_tensors"]
    assert len(cp.shards) == figures["n_files"]
    total = cp.index["metadata"]["total_size"]
    assert abs(total - (32 << 20)) <= (32 << 20) // 10, f"total_size {total} is not ~32 MiB"
    assert figures["bytes"] >= sum(f["len_bytes"] for f in cp.index["ckpt"]["files"])
