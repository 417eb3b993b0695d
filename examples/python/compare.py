#!/usr/bin/env python3
"""Compare two files written by train.py --out: every tensor with torch.equal
(same dtype, shape and bits), every other value with ==. Exit 0 when
identical, 1 (listing the differences) otherwise.

  python compare.py uninterrupted.pt resumed.pt
"""

import sys

import torch


def diff(a, b, path="", out=None):
    out = [] if out is None else out
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: tensor vs {type(b).__name__ if isinstance(a, torch.Tensor) else type(a).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{path}: tensors differ ({a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)})")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{path}: keys differ: {sorted(map(str, set(a) ^ set(b)))}")
        for k in a:
            if k in b:
                diff(a[k], b[k], f"{path}.{k}" if path else str(k), out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: lengths differ ({len(a)} vs {len(b)})")
        for i, (x, y) in enumerate(zip(a, b)):
            diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(f"{path}: {a!r} != {b!r}")
    return out


def count_tensors(x):
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        return sum(count_tensors(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(count_tensors(v) for v in x)
    return 0


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    a, b = (torch.load(p, map_location="cpu", weights_only=False) for p in sys.argv[1:])
    d = diff(a, b)
    if d:
        print(f"DIFFERENT: {len(d)} differences between {sys.argv[1]} and {sys.argv[2]}")
        for line in d[:50]:
            print("  " + line)
        sys.exit(1)
    print(f"IDENTICAL: {count_tensors(a)} tensors (parameters and AdamW state) bit-equal (torch.equal),"
          f" and every other value equal")


if __name__ == "__main__":
    main()
