"""Checkpointer(incremental="trust-version"): torch version counters prove
tensors unchanged, so neither the trainer nor the sidecar copies them again;
writes the counter does not see are missed exactly as docs/python.md says,
and the default mode never misses them."""
import pytest

import ckpt_sidecar as cs

torch = pytest.importorskip("torch", reason="torch not installed: incremental='trust-version' needs torch tensors")


def taken_bytes(ck):
    return ck.status()["unchanged_taken_bytes"]


def trusted(sidecar):
    return cs.Checkpointer(socket=sidecar.socket, spawn=False, incremental="trust-version")


def lora_state(n_base=4, base_elems=64 << 10):
    """A frozen base (never written) and a small adapter with AdamW state."""
    torch.manual_seed(0)
    base = {f"base.{i}": torch.randn(base_elems) for i in range(n_base)}
    adapter = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(adapter.parameters(), lr=0.1)
    return base, adapter, opt


def train_step(adapter, opt):
    adapter(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_incremental_argument_is_checked(sidecar):
    with pytest.raises(cs.InvalidArgument, match="incremental="):
        cs.Checkpointer(socket=sidecar.socket, spawn=False, incremental="trust")
    for mode in (None, "digest"):
        cs.Checkpointer(socket=sidecar.socket, spawn=False, incremental=mode).close()


def test_trusted_mode_takes_unchanged_tensors_from_the_sidecar_not_the_trainer(sidecar):
    """A frozen base is flagged unchanged from the second save on: the sidecar
    takes it from its own copy of the previous step (status counts the bytes)
    and links its shard rather than writing it, the trainer does not copy it
    either, and every step loads bit-equal."""
    base, adapter, opt = lora_state()
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    ck = trusted(sidecar)
    try:
        want = {}
        for step in range(1, 6):
            train_step(adapter, opt)
            state = {"base": base, "adapter": adapter.state_dict(), "opt": opt.state_dict()}
            before = taken_bytes(ck)
            h = ck.save(step, state)
            h.wait_durable(30)
            took = taken_bytes(ck) - before
            # The first save has nothing to compare with; later ones take the base.
            assert took == (0 if step == 1 else base_bytes), (step, took)
            # The trainer copies the base into each of its two save regions
            # once; then only what changed.
            assert (h.copied_bytes >= base_bytes) == (step <= 2), (step, h.copied_bytes)
            # Incremental layouts (the sidecar's default): once the history
            # says which tensors change (step 2's commit) and the previous
            # step has the base in a shard of its own (step 3), the base's
            # shard is linked, not written: neither copied nor written.
            if step >= 4:
                written = ck.status()["last"]["bytes"]
                assert written < base_bytes, (step, written)
            want[step] = {k: v.clone() for k, v in adapter.state_dict().items()}
        for step, ad in want.items():
            back = ck.load(step)
            for k, v in base.items():
                assert torch.equal(back["base"][k], v)
            for k, v in ad.items():
                assert torch.equal(back["adapter"][k], v), (step, k)
    finally:
        ck.close()


def test_trusted_steady_state_copies_the_frozen_base_from_nowhere_and_a_full_every_step_writes_it(tmp_path):
    """Once the layout repeats (step 4 on), the sidecar's copy of the
    previous step becomes the new image: the frozen base is copied neither
    from the trainer nor from that copy (all of it counted in place), and
    its shard is linked; the --full-every steps write it in full from those
    same bytes; every step loads bit-equal."""
    from conftest import Sidecar

    s = Sidecar(tmp_path, args=("--full-every", "3")).start()
    base, adapter, opt = lora_state()
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    ck = trusted(s)
    try:
        want, full_steps = {}, []
        for step in range(1, 9):
            train_step(adapter, opt)
            state = {"base": base, "adapter": adapter.state_dict(), "opt": opt.state_dict()}
            before = ck.status()
            ck.save(step, state).wait_durable(30)
            after = ck.status()
            taken = after["unchanged_taken_bytes"] - before["unchanged_taken_bytes"]
            in_place = after["unchanged_in_place_bytes"] - before["unchanged_in_place_bytes"]
            if step >= 4:
                assert (taken, in_place) == (base_bytes, base_bytes), (step, taken, in_place)
                if after["last"]["bytes"] >= base_bytes:
                    full_steps.append(step)
            want[step] = {k: v.clone() for k, v in adapter.state_dict().items()}
        # Steps 4..8 with --full-every 3: some written in full, the rest linked.
        assert full_steps and len(full_steps) < 5, full_steps
        for step, ad in want.items():
            back = ck.load(step)
            for k, v in base.items():
                assert torch.equal(back["base"][k], v), (step, k)
            for k, v in ad.items():
                assert torch.equal(back["adapter"][k], v), (step, k)
    finally:
        ck.close()
        s.stop()


def test_trusted_mode_misses_a_write_through_data_and_the_default_mode_does_not(sidecar):
    """`.data` gives an alias with a version counter of its own: an in-place
    write through it leaves the tensor's `_version` as it was, so the trusted
    mode saves the OLD bytes (docs/python.md); the default mode saves the new
    ones. Both for a tensor copied at save and one share()d in place."""
    for shared in (False, True):
        for mode, expect_old in (("trust-version", True), (None, False)):
            ck = cs.Checkpointer(socket=sidecar.socket, spawn=False, incremental=mode)
            try:
                w = torch.zeros(1 << 16)
                if shared:
                    w = ck.share(w)
                state = {"w": w, "step": torch.zeros(1)}
                first = 10 * (2 * shared + (mode is None)) + 1
                ck.save(first, state).wait_durable(30)
                v = w._version
                w.data.add_(1)  # behind torch's back: the version counter does not move
                assert w._version == v
                state["step"].add_(1)
                ck.save(first + 1, state).wait_durable(30)
                back = ck.load(first + 1)
                assert torch.equal(back["step"], torch.ones(1))
                assert torch.equal(back["w"], torch.zeros(1 << 16) if expect_old else torch.ones(1 << 16)), (shared, mode)
            finally:
                ck.close()


def test_trusted_mode_never_misses_a_change_made_by_torch(sidecar):
    """Changes through torch (add_ on the tensor, a view, a detach() alias,
    under no_grad, an optimizer step, a tensor replaced by a new one) always
    reach the checkpoint."""
    ck = trusted(sidecar)
    try:
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = torch.optim.SGD([p], lr=1.0)
        state = {"p": p, "a": torch.zeros(4096), "b": torch.zeros(4096), "c": torch.zeros(4096), "d": torch.zeros(4096)}
        ck.save(1, state).wait_durable(30)

        def under_no_grad():
            with torch.no_grad():
                state["d"].add_(2)

        changes = [
            lambda: state["a"].add_(1),
            lambda: state["b"][10:20].fill_(3),  # through a view
            lambda: state["c"].detach().mul_(0).add_(5),  # detach() shares the counter
            under_no_grad,
            lambda: (p.sum().backward(), opt.step()),
            lambda: state.__setitem__("a", torch.full((4096,), 9.0)),  # a new tensor
        ]
        for k, change in enumerate(changes):
            change()
            want = {name: t.detach().clone() for name, t in state.items()}
            ck.save(2 + k, state).wait_durable(30)
            back = ck.load(2 + k)
            for name, t in want.items():
                assert torch.equal(back[name], t), (k, name)
    finally:
        ck.close()


def test_a_failed_save_does_not_lend_its_versions(sidecar):
    """A save that fails (its step already committed) must not count as the
    base of the next one: the tensor changed before it is saved anew, not
    taken from the committed step of the same number."""
    ck = trusted(sidecar)
    try:
        w = torch.zeros(1 << 16)
        state = {"w": w}
        ck.save(1, state).wait_durable(30)
        w.add_(1)
        with pytest.raises(cs.SidecarError, match="already committed"):
            ck.save(1, state).wait_durable(30)
        ck.save(2, state).wait_durable(30)
        assert torch.equal(ck.load(2)["w"], torch.ones(1 << 16))
    finally:
        ck.close()


def test_numpy_arrays_are_never_trusted(sidecar):
    np = pytest.importorskip("numpy")
    ck = trusted(sidecar)
    try:
        a = np.zeros(1 << 16, dtype=np.float32)
        ck.save(1, {"a": a}).wait_durable(30)
        a += 1
        before = taken_bytes(ck)
        ck.save(2, {"a": a}).wait_durable(30)
        assert taken_bytes(ck) == before
        assert (ck.load(2)["a"] == 1).all()
    finally:
        ck.close()


def test_load_into_and_rollback_forget_what_was_proven(sidecar):
    """load_into writes share()d tensors in place (no version bump) and a
    rollback un-commits steps: the next save copies everything."""
    ck = trusted(sidecar)
    try:
        w = ck.share(torch.zeros(1 << 16))
        state = {"w": w}
        ck.save(1, state).wait_durable(30)
        w.add_(1)
        ck.save(2, state).wait_durable(30)
        ck.load_into(state, step=1)  # the sidecar writes w's memory: zeros, same _version
        assert torch.equal(w, torch.zeros(1 << 16))
        before = taken_bytes(ck)
        ck.save(3, state).wait_durable(30)
        assert taken_bytes(ck) == before
        assert torch.equal(ck.load(3)["w"], torch.zeros(1 << 16))
        ck.rollback(1)
        before = taken_bytes(ck)
        ck.save(2, state).wait_durable(30)
        assert taken_bytes(ck) == before
    finally:
        ck.close()


def test_status_json_shows_the_unchanged_counters_the_daemon_keeps(sidecar):
    """`ckpt-sidecar status --json` printed neither `unchanged_taken_bytes`
    nor `unchanged_in_place_bytes`, though the daemon's report (what
    Checkpointer.status() returns) has them."""
    import json
    import subprocess

    from conftest import sidecar_bin

    base, adapter, opt = lora_state()
    ck = trusted(sidecar)
    try:
        for step in range(1, 5):
            train_step(adapter, opt)
            ck.save(step, {"base": base, "adapter": adapter.state_dict(), "opt": opt.state_dict()}).wait_durable(30)
        want = ck.status()
    finally:
        ck.close()
    out = subprocess.run([sidecar_bin(), "status", "--json", "--socket", sidecar.socket], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    j = json.loads(out.stdout)
    assert want["unchanged_taken_bytes"] > 0
    assert j["unchanged_taken_bytes"] == want["unchanged_taken_bytes"]
    assert j["unchanged_in_place_bytes"] == want["unchanged_in_place_bytes"]
    text = subprocess.run([sidecar_bin(), "status", "--socket", sidecar.socket], capture_output=True, text=True, timeout=30)
    assert text.returncode == 0 and "unchanged:" in text.stdout, text.stdout
