"""Sizes and steps as the command line takes them, checked in Python before
anything is spawned or sent, with the same meaning and the same words as the
Rust parser (store/src/units.rs): decimal units are powers of 1000 (KB, MB,
GB, TB, PB), binary ones powers of 1024 (KiB ... PiB), a bare K/M/G/T/P is
binary, no unit or B is bytes, case is ignored, fractions are exact."""

import json
import numbers
import os

STEP_MAX = 999_999_999_999  # the largest step a folder name holds (docs/format.md)
U64_MAX = (1 << 64) - 1
I64_MAX = (1 << 63) - 1

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "p": 1 << 50,
    "pib": 1 << 50,
}


def _q(text):
    """Quoted as the Rust parser quotes (its Debug format)."""
    return json.dumps(text)


def parse_size(text, what="size"):
    """Bytes in `text` ("512MiB", "1.5GB", "1048576"); ValueError naming it
    (as `what`, e.g. an environment variable), in the words of the command
    line's parser."""
    s = text.strip()
    split = next((i for i, c in enumerate(s) if not (c.isascii() and c.isdigit()) and c != "."), len(s))
    num, unit = s[:split], s[split:]
    expected = f"{what} {_q(text)}: expected a number and an optional unit, like 512MiB, 1.5GB or 1048576"
    intp, _, frac = num.partition(".")
    if not intp and not frac or "." in frac or len(intp) > 20 or len(frac) > 18:
        raise ValueError(expected)
    u = unit.strip().lower()
    mult = _UNITS.get(u)
    if mult is None:
        raise ValueError(
            f"{what} {_q(text)}: unknown unit {_q(u)} (bytes, or KB MB GB TB PB = powers of 1000, "
            "KiB MiB GiB TiB PiB = powers of 1024)"
        )
    scale = 10 ** len(frac)
    frac_bytes = (int(frac) if frac else 0) * mult
    if frac_bytes % scale:
        raise ValueError(f"{what} {_q(text)} is not a whole number of bytes")
    total = (int(intp) if intp else 0) * mult + frac_bytes // scale
    if total > U64_MAX:
        raise ValueError(f"{what} {_q(text)} is too large (at most 16 EiB)")
    return total


def human_bytes(b):
    """A size for people, as the command line prints it: "512 B", "1.5 GiB"."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    v, i = float(b), 0
    while v >= 1024.0 and i < len(units) - 1:
        v /= 1024.0
        i += 1
    return f"{b} B" if i == 0 else f"{v:.1f} {units[i]}"


def size_arg(name, value):
    """A size option (int bytes or a string with a unit), at least 1 byte."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, str)):
        raise TypeError(f"{name}={value!r}: give a size as an int of bytes or a string like '512MiB'")
    n = parse_size(value) if isinstance(value, str) else int(value)
    if n < 1 or n > U64_MAX:
        raise ValueError(f"{name}={value!r}: a size must be from 1 byte to 16 EiB")
    return n


def env_size(name, environ):
    """The size in environment variable `name` (None when unset or empty),
    at least 1 byte; ValueError naming the variable."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    n = parse_size(raw, what=name)
    if n < 1:
        raise ValueError(f"{name} {_q(raw)}: a size must be at least 1 byte")
    return n


def count_arg(name, value):
    """A count option (keep=N): an int of at least 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r}: must be an int of at least 1")
    return int(value)


def path_arg(name, value):
    """A path option (str, bytes or os.PathLike, not empty) as a str."""
    try:
        path = os.fsdecode(os.fspath(value))
    except TypeError:
        raise TypeError(f"{name}={value!r}: give a path (a str or an os.PathLike)") from None
    if not path:
        raise ValueError(f"{name}={value!r}: an empty path names no directory or file")
    return path


CPU_INDEX_MAX = (1 << 16) - 1  # as the command line's --cpus parser


def cpus_arg(value):
    """CPUs for --cpus: a CPU list string ("1", "2-7,12") or ints, checked as
    the command line checks it; returned as the string passed on."""
    if isinstance(value, str):
        ok = bool(value.strip())
        for part in value.split(","):
            a, _, b = part.strip().partition("-")
            b = b if _ else a
            if not (a.isdigit() and b.isdigit() and int(a) <= int(b) <= CPU_INDEX_MAX):
                ok = False
        if not ok:
            raise ValueError(f"cpus={value!r}: {_q(value)} is not a CPU list like 1 or 2-7,12")
        return value
    try:
        cpus = list(value)
    except TypeError:
        raise TypeError(f'cpus={value!r}: give a CPU list like "2-7,12" or a list of ints') from None
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, numbers.Integral) or not 0 <= c <= CPU_INDEX_MAX]
    if bad or not cpus:
        raise ValueError(f'cpus={value!r}: give CPU numbers from 0 to {CPU_INDEX_MAX} (a list of ints, or "2-7,12")')
    return ",".join(str(int(c)) for c in cpus)


def timeout_ms(timeout):
    """A wait's timeout in seconds (None or inf: no limit) as milliseconds
    for the shim (-1: no limit); a negative, NaN or non-number timeout raises."""
    if timeout is None:
        return -1
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout={timeout!r}: give seconds as a number, or None to wait without a limit")
    t = float(timeout)
    if not t >= 0:  # NaN too
        raise ValueError(f"timeout={timeout!r}: give seconds from 0 up, or None to wait without a limit")
    return -1 if t * 1000 >= I64_MAX else int(t * 1000)


def step_arg(step, latest_ok=False):
    """A step: an int from 0 to STEP_MAX (bool refused); with latest_ok,
    also "latest" (or None), returned as None."""
    if latest_ok and (step is None or step == "latest"):
        return None
    if isinstance(step, str):
        raise ValueError(f"step {step!r}: a step is a non-negative int" + (' or "latest"' if latest_ok else ""))
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        also = ' or "latest"' if latest_ok else ""
        raise TypeError(f"step {step!r}: a step is a non-negative int{also}")
    if not 0 <= step <= STEP_MAX:
        also = ' (or "latest")' if latest_ok else ""
        raise ValueError(f"step {step!r}: a step is an int from 0 to {STEP_MAX}{also}")
    return int(step)


# How the torch.save hook treats CUDA storages (its docstring says more):
# "device" (the default): the sidecar copies them from the device, and the
# hook holds no host copy; "host": the trainer copies them to the host as the
# original torch.save does, and the hook can write the file itself if the
# sidecar dies before it is durable.
HOOK_CUDA_ENV = "CKPT_SIDECAR_HOOK_CUDA"
HOOK_CUDA_MODES = ("device", "host")


def hook_cuda_mode(environ):
    """(mode, complaint): the mode $CKPT_SIDECAR_HOOK_CUDA names in `environ`
    ("device" when unset or empty); an unknown value gives "host", the mode
    that loses nothing, and one line saying what is wrong."""
    raw = environ.get(HOOK_CUDA_ENV, "")
    value = raw.strip().lower() or HOOK_CUDA_MODES[0]
    if value in HOOK_CUDA_MODES:
        return value, None
    return "host", (
        f"{HOOK_CUDA_ENV}={_q(raw)}: expected one of {', '.join(HOOK_CUDA_MODES)}; "
        "CUDA tensors are copied to the host by the trainer"
    )
