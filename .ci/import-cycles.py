#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle.

ARCHITECTURE.md's layers are only walls if no file reaches back up: for each
crate (a folder with src/lib.rs), builds the graph "file A names `crate::b`"
and prints every cycle. Usage: python3 .ci/import-cycles.py [ROOT]
"""
import pathlib, re, sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
bad = 0
for lib in sorted(root.glob("*/src/lib.rs")):
    src = lib.parent
    mods = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "mod":
            parts = parts[:-1]
        if parts in (["lib"], ["main"]):
            continue
        mods[parts[0]] = mods.get(parts[0], []) + [f]
    graph = {}
    for m, files in mods.items():
        text = "".join(re.sub(r"#\[cfg\(test\)\][\s\S]*", "", f.read_text()) for f in files)
        text = re.sub(r"//[^\n]*", "", text)
        graph[m] = {d for d in re.findall(r"crate::([a-z_0-9]+)", text) if d in mods and d != m}
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append(stack[stack.index(n):] + [n])
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
    for c in cycles:
        bad += 1
        print(f"{lib.parent.parent.name}: import cycle: {' -> '.join(c)}")
print(f"import cycles: {bad}")
sys.exit(1 if bad else 0)
