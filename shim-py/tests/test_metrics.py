"""`serve --metrics ADDR`: GET /metrics answers OpenMetrics text with ckpt_
lines; scraped during saves its counters stay consistent, and at rest it
agrees with the status report (docs/metrics.md)."""
import re
import subprocess
import threading
import urllib.request

import numpy as np
import pytest

from ckpt_test_util import wait_until
from conftest import STAGING, Sidecar, sidecar_bin


class MetricsSidecar(Sidecar):
    def __init__(self, tmp_path):
        super().__init__(tmp_path, args=("--metrics", "127.0.0.1:0"))

    def start(self):
        super().start()
        # The metrics listener is bound before the socket is published, and logged.
        self.url = re.search(r"metrics=(http://\S+/metrics)", self.log.read_text()).group(1)
        return self


@pytest.fixture
def msidecar(tmp_path):
    s = MetricsSidecar(tmp_path).start()
    yield s
    s.stop()


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        return r.read().decode()


def parse(text):
    """{(name, labels): value} of the exposition's samples (labels as a sorted
    tuple of pairs); every line checked against the text format."""
    assert text.endswith("# EOF\n"), text[-200:]
    out = {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE|EOF)", line), line
            continue
        m = sample.match(line)
        assert m, line
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_answers_get_metrics_with_ckpt_lines_after_a_save(msidecar):
    import ckpt_sidecar as cs

    ck = cs.Checkpointer(socket=msidecar.socket, spawn=False)
    try:
        ck.save(1, {"w": np.arange(1000, dtype=np.float32)}).wait_durable()
    finally:
        ck.close()
    text = scrape(msidecar.url)
    assert any(line.startswith("ckpt_") for line in text.splitlines()), text
    s = parse(text)
    assert value(s, "ckpt_checkpoints_durable_total") == 1
    assert value(s, "ckpt_bytes_written_total") > 4000


def test_metrics_scraped_during_saves_agree_with_status(msidecar):
    import ckpt_sidecar as cs

    n_saves = 12
    ck = cs.Checkpointer(socket=msidecar.socket, spawn=False)
    done = threading.Event()
    errors = []

    def saves():
        try:
            for step in range(1, n_saves + 1):
                ck.save(step, {"w": np.full(256 << 10, step, dtype=np.float32)}).wait_durable()
        except Exception as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=saves)
    t.start()
    scrapes = []
    while not done.is_set():  # scraped while saves run
        scrapes.append(parse(scrape(msidecar.url)))
    t.join()
    assert not errors, errors
    for s in scrapes:
        started, durable = value(s, "ckpt_checkpoints_started_total"), value(s, "ckpt_checkpoints_durable_total")
        assert value(s, "ckpt_checkpoints_released_total") <= started
        assert durable <= started
        # (A durable save stays in flight until its retention is done.)
        assert value(s, "ckpt_in_flight") <= started
        assert value(s, "ckpt_durable_seconds_count") == durable
        assert value(s, "ckpt_staging_used_bytes") <= value(s, "ckpt_staging_bytes")
    # A failed save: the same step again (already committed: bad_request).
    with pytest.raises(cs.SidecarError):
        ck.save(n_saves, {"w": np.zeros(4, dtype=np.float32)}).wait_durable()
    try:
        # At rest: the last save's flight ends after its Durable (retention
        # runs after it), so a status taken at once may still show it.
        wait_until(lambda: not ck.status()["in_flight"], 60, "the last save's flight ending")
        status = ck.status()
        s = parse(scrape(msidecar.url))
    finally:
        ck.close()
    assert value(s, "ckpt_checkpoints_started_total") == n_saves
    assert value(s, "ckpt_checkpoints_released_total") == n_saves
    assert value(s, "ckpt_checkpoints_durable_total") == n_saves
    assert value(s, "ckpt_checkpoints_failed_total", reason="bad_request") == 1
    assert value(s, "ckpt_release_seconds_count") == n_saves
    assert value(s, "ckpt_bytes_written_total") >= n_saves * (1 << 20)
    # The gauges are read from the same report as status.
    assert value(s, "ckpt_staging_bytes") == status["staging_bytes"]
    assert value(s, "ckpt_staging_used_bytes") == status["staging_used_bytes"]
    assert value(s, "ckpt_in_flight") == len(status["in_flight"]) == 0
    assert value(s, "ckpt_sessions") == len(status["sessions"]) == 1
    # Counters read from the same report (nothing flagged unchanged here).
    assert value(s, "ckpt_unchanged_taken_bytes_total") == status["unchanged_taken_bytes"] == 0
    assert value(s, "ckpt_unchanged_in_place_bytes_total") == status["unchanged_in_place_bytes"] == 0


def test_metrics_port_taken_fails_the_start(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        r = subprocess.run([sidecar_bin(), "serve", "--dir", str(tmp_path / "d"), "--socket", str(tmp_path / "s.sock"),
                            "--staging", STAGING, "--metrics", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           timeout=60)
    finally:
        taken.close()
    assert r.returncode == 1, r.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics)" in r.stderr, r.stderr
    assert not (tmp_path / "s.sock").exists()
