#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle, file by
file or folder by folder.

ARCHITECTURE.md's layers are only walls if no file reaches back up. For each
crate (a folder with src/lib.rs) it builds two graphs from "file A names
`crate::b::c`" (code only: comments and `#[cfg(test)]` tails are left out):
- modules: one node per file (`save::snapshot`), so no two files of a crate
  import each other, directly or around a circle;
- layers: one node per top-level module or folder (`save`), so the folders
  stack as layers: none reaches a folder that reaches back to it, and where
  LAYERS below declares a crate's order (ARCHITECTURE.md's code map lists
  it), none reaches a folder declared after it.
Every cycle and every upward edge is printed.
Usage: python3 .ci/import-cycles.py [ROOT]
"""
import pathlib
import re
import sys


# A crate's folders (and top-level files), lowest layer first: each may use
# only those before it. The binary's cli/ uses the library by its name.
LAYERS = {
    "sidecar": ["config", "priority", "memory", "drain", "peer", "state", "save", "commit", "load", "scrub", "daemon", "cli"],
}


def module_of(src, f):
    parts = list(f.relative_to(src).with_suffix("").parts)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def code_of(f):
    text = re.sub(r"#\[cfg\(test\)\][\s\S]*", "", f.read_text())
    return re.sub(r"//[^\n]*", "", text)


def cycles_of(graph):
    seen, stack, found = set(), [], []

    def visit(n):
        if n in stack:
            found.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for d in sorted(graph[n]):
            visit(d)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    return found


def graphs_of(src):
    mods = {}
    for f in src.rglob("*.rs"):
        m = module_of(src, f)
        if m in ((), ("lib",), ("main",)):
            continue
        mods[m] = f
    files, layers = {m: set() for m in mods}, {m[0]: set() for m in mods}
    for m, f in mods.items():
        for path in re.findall(r"crate::((?:[a-z_0-9]+::)*[a-z_0-9]+)", code_of(f)):
            parts = tuple(path.split("::"))
            # The longest prefix that is a module of the crate (the rest names an item).
            target = next((parts[:k] for k in range(len(parts), 0, -1) if parts[:k] in mods), None)
            if target is None:
                continue
            # A folder's own mod.rs is the parent of its files, not a peer:
            # an edge between a module and its ancestor is no layer crossing.
            if target != m and target != m[: len(target)] and m != target[: len(m)]:
                files[m].add(target)
            if target[0] != m[0]:
                layers[m[0]].add(target[0])
    return files, layers


root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
bad = 0
for lib in sorted(root.glob("*/src/lib.rs")):
    crate = lib.parent.parent.name
    files, layers = graphs_of(lib.parent)
    for c in cycles_of(files):
        bad += 1
        print(f"{crate}: import cycle: {' -> '.join('::'.join(m) for m in c)}")
    for c in cycles_of(layers):
        bad += 1
        print(f"{crate}: layer cycle (folders): {' -> '.join(c)}")
    order = LAYERS.get(crate)
    if order:
        for m in sorted(set(layers) - set(order)):
            bad += 1
            print(f"{crate}: {m} is in no layer: add it to LAYERS in {sys.argv[0]}")
        for m, deps in sorted(layers.items()):
            for d in sorted(deps):
                if m in order and d in order and order.index(d) > order.index(m):
                    bad += 1
                    print(f"{crate}: layer {m} reaches up to {d} (order: {' < '.join(order)})")
print(f"import cycles: {bad}")
sys.exit(1 if bad else 0)
