"""The states bench compare saves (a transformer-like state of float32
tensors, or a LoRA-like one: a frozen base plus adapters and AdamW-like
moments written before every save), and the run's progress log and
medians."""

import statistics
import sys
import time

import torch

# The smallest state make_state builds: its 32 norm vectors of 1024 float32.
STATE_BYTES_MIN = 32 * 4096


def log(msg):
    print(f"[bench compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def make_state(size_bytes):
    """size_bytes of float32: 16 MiB matrices, the rest in one tail tensor, plus 32 small norms."""
    g = torch.Generator().manual_seed(0)
    state, total, i = {}, size_bytes - 32 * 4096, 0
    big = 16 << 20
    while total >= big:
        state[f"layers.{i}.weight"] = torch.rand(1024, 4096, generator=g)
        total -= big
        i += 1
    if total >= 4:
        state["tail.weight"] = torch.rand(total // 4, generator=g)
    for j in range(32):
        state[f"layers.{j}.norm.weight"] = torch.rand(1024, generator=g)
    return state


def make_lora_state(base_bytes, adapter_bytes):
    """A frozen base of about base_bytes (make_state's tensors) and adapters of
    adapter_bytes float32 in 1 MiB tensors, each with two AdamW-like moments;
    returns (state, the tensors written at every step)."""
    state = {f"base.{k}": t for k, t in make_state(base_bytes).items()}
    g = torch.Generator().manual_seed(1)
    changing = []
    n = max(1, adapter_bytes // (1 << 20))
    per = max(1, adapter_bytes // n // 4)
    for i in range(n):
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            t = torch.rand(per, generator=g)
            state[f"adapter.{i}.{kind}"] = t
            changing.append(t)
    return state, changing


def train_adapters(changing):
    """One optimizer step's writes: every adapter tensor and moment in place."""
    with torch.no_grad():
        for t in changing:
            t.add_(1e-3)


def nbytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())
