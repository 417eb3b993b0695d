"""The documentation is run and checked, so what a user pastes works and the
reference cannot drift from the code.

- Every fenced `python` and `sh` block of README.md and docs/guide.md runs on
  its own, in a fresh temp dir, with this venv's Python, `ckpt-sidecar` on
  PATH and no sidecar running (a Checkpointer spawns its own). A block whose
  first line is `# not run: WHY` is skipped, with its reason. A block whose
  first line names a file (`# train.py: ...`, `// trainer.c`) is also written
  under that name into the folder every `sh` block of the same document runs
  in, beside links to the repository's `shim-c` and `target`.
- README.md: the size and first-screen bars, and its test
  command is the one `.ci/run` runs.
- docs/cli.md names every option `ckpt-sidecar <command> --help` prints, and
  every CKPT_SIDECAR_* variable the code reads.
- docs/python.md names every public name of `ckpt_sidecar`, of
  `ckpt_sidecar.dcp`, and every public method of Checkpointer and SaveHandle.
"""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_DOCS = ("README.md", "docs/guide.md")
BLOCK_TIMEOUT_S = 600  # a bound on a hang, not a timing: a block takes seconds
NOT_RUN = re.compile(r"^\s*(#|//)\s*not run:\s*\S")
NAMED_FILE = re.compile(r"^\s*(?:#|//)\s*([A-Za-z0-9_.-]+\.(?:py|c|sh))\b")
# The README's opening block: what CI runs itself (.ci/run), and the demo (minutes).
README_COMMANDS = ["bash examples/python/demo.sh", "bash .ci/test"]


def fenced_blocks(path):
    """[(lang, line number of the opening fence, text)] of a Markdown file."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if lang is None:
            if line.startswith("```"):
                lang, start, body = line[3:].strip().lower(), n, []
        elif line.startswith("```"):
            out.append((lang, start, "\n".join(body) + "\n"))
            lang = None
        else:
            body.append(line)
    assert lang is None, f"{path}: the block opened at line {start} is never closed"
    return out


def runnable(doc):
    return [(doc, lang, line, text) for lang, line, text in fenced_blocks(REPO / doc)
            if lang in ("python", "sh", "bash")]


def _is_readme_commands(doc, text):
    """README.md's opening block: exactly the main job and the test command."""
    return doc == "README.md" and [l.split("#")[0].strip() for l in text.strip().splitlines()] == README_COMMANDS


BLOCKS = [b for doc in RUN_DOCS for b in runnable(doc)]


@pytest.fixture(scope="module")
def tool_bin(tmp_path_factory, sidecar_bin):
    """A folder for PATH: `python` (this venv's), `torchrun` over it, and
    ckpt-sidecar's own folder after it."""
    d = tmp_path_factory.mktemp("bin")
    # Scripts, not links: a venv's Python finds its venv from the path it was run by.
    for name, args in (("python", ""), ("python3", ""), ("torchrun", " -m torch.distributed.run")):
        (d / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (d / name).chmod(0o755)
    return d


def _env(tool_bin, sidecar_bin):
    env = dict(os.environ)
    for k in list(env):
        # No outer sidecar, hook or engine setting leaks into a user's first run.
        if k.startswith("CKPT_SIDECAR") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del env[k]
    env["CKPT_SIDECAR_BIN"] = str(sidecar_bin)
    env["CKPT_SIDECAR_LOG"] = "warn"
    env["PATH"] = os.pathsep.join([str(tool_bin), str(Path(sidecar_bin).parent), env.get("PATH", "")])
    return env


def _run(cmd, cwd, env, what):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    if p.returncode != 0:
        pytest.fail(f"{what} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p


@pytest.mark.parametrize("doc,lang,line,text", BLOCKS, ids=[f"{d}:{n}" for d, _, n, _ in BLOCKS])
def test_doc_block_runs(doc, lang, line, text, tmp_path, tool_bin, sidecar_bin):
    first = text.lstrip("\n").split("\n", 1)[0]
    if NOT_RUN.match(first):
        pytest.skip(f"{doc}:{line}: {first.strip()}")
    if _is_readme_commands(doc, text):
        pytest.skip(f"{doc}:{line}: the opening commands (.ci/test is this suite; see test_readme_test_command_is_what_ci_runs)")
    env = _env(tool_bin, sidecar_bin)
    if lang == "python":
        m = NAMED_FILE.match(first)
        script = tmp_path / (m.group(1) if m else "block.py")
        script.write_text(text)
        _run([sys.executable, script.name], tmp_path, env, f"python block at {doc}:{line}")
        return
    # sh: the document's named files and the repository's build beside it.
    for _, _, body in fenced_blocks(REPO / doc):
        m = NAMED_FILE.match(body.lstrip("\n").split("\n", 1)[0])
        if m:
            (tmp_path / m.group(1)).write_text(body)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    (tmp_path / "target").symlink_to(target)
    (tmp_path / "shim-c").symlink_to(REPO / "shim-c")
    script = tmp_path / "block.sh"
    script.write_text("set -euo pipefail\n" + text)
    _run(["bash", str(script)], tmp_path, env, f"sh block at {doc}:{line}")


def test_readme_bars():
    """At most 250 lines; within the first 80, a Python block using
    Checkpointer and guard, and a line with CKPT_SIDECAR=1."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    head = [(lang, n, t) for lang, n, t in fenced_blocks(REPO / "README.md")
            if lang == "python" and n + t.count("\n") <= 80]
    assert any("Checkpointer" in t and ".guard(" in t for _, _, t in head), \
        "no python block using Checkpointer and guard within README.md's first 80 lines"
    assert any("CKPT_SIDECAR=1" in l for l in lines[:80]), "no line with CKPT_SIDECAR=1 in README.md's first 80 lines"


def test_readme_test_command_is_what_ci_runs():
    """README.md opens with the main job and the test command, and .ci/run
    (CI) runs that test command."""
    first = next((lang, t) for lang, _, t in fenced_blocks(REPO / "README.md"))
    assert _is_readme_commands("README.md", first[1]), f"README.md's first block is not {README_COMMANDS}: {first[1]!r}"
    run = (REPO / ".ci/run").read_text()
    assert re.search(r"^bash \.ci/test$", run, re.M), ".ci/run does not run `bash .ci/test`"
    assert (REPO / "examples/python/demo.sh").is_file()


def _anchors(path):
    """The anchors GitHub gives the headings of a Markdown file."""
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_doc_links_resolve():
    """Every relative link of the user docs names a file that exists, and
    a heading of it that exists."""
    bad = []
    for doc in ("README.md", "docs/guide.md", "docs/cli.md", "docs/python.md", "docs/performance.md",
                "docs/testing.md", "shim-py/README.md"):
        path = REPO / doc
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if "://" in target:
                continue
            dest = (path.parent / target) if target else path
            if not dest.exists():
                bad.append(f"{doc}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc}: {target}#{anchor}: no such heading")
    assert not bad, "\n".join(bad)


# ---- docs/cli.md against the binary ----

def _help(sidecar_bin, *args):
    env = dict(os.environ, CKPT_SIDECAR_PYTHON=sys.executable)
    p = subprocess.run([str(sidecar_bin), *args, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, f"ckpt-sidecar {' '.join(args)} --help exited {p.returncode}: {p.stderr}"
    return p.stdout


def _commands(help_text):
    """The subcommand names of a clap help text's Commands: section."""
    out, inside = [], False
    for line in help_text.splitlines():
        if line.strip() == "Commands:":
            inside = True
        elif inside and not line.startswith("  "):
            inside = False
        elif inside and line.strip():
            name = line.split()[0]
            if name != "help":
                out.append(name)
    return out


def test_cli_md_names_every_command_and_option(sidecar_bin):
    cli = (REPO / "docs/cli.md").read_text()
    top = _commands(_help(sidecar_bin))
    bench = _commands(_help(sidecar_bin, "bench"))
    assert "serve" in top and "write" in bench, "could not read the command lists from --help"
    missing = []
    subs = [[c] for c in top if c != "bench"] + [["bench", b] for b in bench]
    for sub in subs:
        heading = f"`{' '.join(sub)}"
        if heading not in cli:
            missing.append(f"command {' '.join(sub)}")
        for opt in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", _help(sidecar_bin, *sub)))):
            if opt in ("--help", "--version"):
                continue
            if not re.search(re.escape(opt) + r"(?![a-z0-9-])", cli):
                missing.append(f"{' '.join(sub)} {opt}")
    assert not missing, f"docs/cli.md lacks: {', '.join(missing)}"


def test_cli_md_names_every_environment_variable():
    cli = (REPO / "docs/cli.md").read_text()
    found = set()
    for pattern in ("sidecar/src/**/*.rs", "store/src/**/*.rs", "shim-c/src/**/*.rs", "client/src/**/*.rs",
                    "bench/src/**/*.rs", "shim-py/ckpt_sidecar/*.py", "shim-py/setup.py"):
        for f in REPO.glob(pattern):
            found |= set(re.findall(r"\bCKPT_SIDECAR_[A-Z0-9_]*[A-Z0-9]\b", f.read_text()))
    assert found, "found no CKPT_SIDECAR_* variables in the code"
    missing = sorted(v for v in found if not re.search(re.escape(v) + r"(?![A-Z0-9_])", cli))
    assert not missing, f"docs/cli.md does not name: {missing}"


# ---- docs/python.md against the package ----

def _public_names():
    import ckpt_sidecar as cs

    names = {n for n in dir(cs) if not n.startswith("_") and not inspect.ismodule(getattr(cs, n))}
    names |= set(getattr(cs, "_LAZY", {}))
    names |= set(getattr(cs, "__all__", ()))
    names.add("__version__")
    for n in list(names):
        obj = getattr(cs, n)
        if n in ("Checkpointer", "SaveHandle", "LoadedInto"):
            # Its methods, whichever of the package's classes it inherits them from.
            names |= {f"{n}.{m}" for k in obj.__mro__ if k.__module__.startswith("ckpt_sidecar")
                      for m in vars(k) if not m.startswith("_")}
    try:
        import ckpt_sidecar.dcp  # noqa: F401 - only whether it imports
    except ImportError as e:  # torch missing: the rest is still checked
        print(f"ckpt_sidecar.dcp not checked: {e}")
    else:
        names |= {f"dcp.{n}" for n in ("SidecarWriter", "SidecarReader")}
    return names


def test_python_md_names_every_public_name():
    doc = (REPO / "docs/python.md").read_text()
    code_spans = " ".join(re.findall(r"`[^`\n]+`", doc))
    missing = []
    for qual in sorted(_public_names()):
        name = qual.rsplit(".", 1)[-1]
        if not re.search(r"(?<![\w])" + re.escape(name) + r"(?![\w])", code_spans):
            missing.append(qual)
    assert not missing, f"docs/python.md does not name: {missing}"
