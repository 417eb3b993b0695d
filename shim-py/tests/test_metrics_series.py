"""docs/metrics.md lists every series a scrape has, with its type, and a
scrape has every series it lists (with a drain target and the scrub, so
that their series are there too); the drain's series agree with `status`,
and so do the damage and scrub series."""
import re
from pathlib import Path

import ckpt_sidecar as cs
import numpy as np

from test_drain import Drained
from test_metrics import parse, scrape

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented():
    """{(family, type)} of the doc's tables: `ckpt_x_total{label}` | counter."""
    rows = re.findall(r"^\| `(ckpt_[a-z_]+)(?:\{[a-z_]+\})?` \| (counter|gauge|histogram) \|", DOC.read_text(), re.M)
    return {(name.removesuffix("_total") if kind == "counter" else name, kind) for name, kind in rows}


def scraped(text):
    return set(re.findall(r"^# TYPE (ckpt_[a-z_]+) (counter|gauge|histogram)$", text, re.M))


def test_every_series_scraped_is_documented_and_every_documented_one_scraped(tmp_path):
    remote = tmp_path / "R"
    remote.mkdir()
    s = Drained(tmp_path, "m", tmp_path / "L", f"file://{remote}", "--metrics", "127.0.0.1:0", "--keep", "2", "--scrub-interval", "100ms").start()
    try:
        url = re.search(r"metrics=(http://\S+/metrics)", s.log.read_text()).group(1)
        with cs.Checkpointer(socket=s.socket, spawn=False) as ck:
            for step in (1, 2, 3):
                ck.save(step, {"w": np.full(4096, step, np.float32)}).wait_replicated(timeout=60)
            ck.load()
        text = scrape(url)
        assert any(line.startswith("ckpt_drain_") for line in text.splitlines()), text
        assert scraped(text) - documented() == set(), "scraped, not in docs/metrics.md"
        assert documented() - scraped(text) == set(), "in docs/metrics.md, not scraped"
        m = parse(text)
        d = s.drain()
        assert m[("ckpt_drain_up", ())] == 1 and d["state"] == "up"
        assert m[("ckpt_drain_last_replicated_step", ())] == 3 == d["last_replicated"]
        assert m[("ckpt_drain_replicated_total", ())] == 3 == d["replicated_count"]
        assert m[("ckpt_drain_backlog_steps", ())] == 0 and d["backlog"] == [] and d["lag_seconds"] == 0
        assert m[("ckpt_loads_total", (("source", "ram"),))] == 1
        st = s.status()
        assert st["damaged"] == [] and m[("ckpt_damaged_steps", ())] == 0
        for by in ("load", "drain", "scrub", "scrub_drain"):
            assert m[("ckpt_damage_found_total", (("by", by),))] == 0
        assert m[("ckpt_scrub_passes_total", ())] <= st["scrub"]["passes"]
    finally:
        s.stop()
