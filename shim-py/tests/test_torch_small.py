"""A small torch round trip (the full torch tests live beside the examples);
skipped, saying why, without torch."""
import pytest



def test_torch_module_and_optimizer_round_trip(ck):
    torch = pytest.importorskip("torch", reason="torch not installed: torch round trip skipped")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"model": m.state_dict(), "optim": opt.state_dict(), "t": base.t(), "v": base[1:3],
             "bf": torch.ones(3, dtype=torch.bfloat16), "e": torch.empty(0, 2), "b": torch.tensor([True, False])}
    ck.guard(opt)
    ck.save(1, state).wait_durable(30)
    back = ck.load(1)
    for k, v in m.state_dict().items():
        assert torch.equal(back["model"][k], v)
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(back["t"], base.t()) and torch.equal(back["v"], base[1:3])
    assert back["bf"].dtype == torch.bfloat16 and back["e"].shape == (0, 2) and back["b"].tolist() == [True, False]
    ck.share(m)
    h = ck.save(2, {"model": m.state_dict()})
    assert h.copied_bytes == 0
    m(torch.randn(2, 4)).sum().backward()
    opt.step()  # the guard waits for the release first
    h.wait_durable(30)


def test_state_dicts_saved_again_carry_their_new_values(ck):
    """A fresh state_dict() holds new tensor objects over the same memory: the
    save reuses its prepared request, and still sends what the memory holds
    now, in place (shared) or copied; a parameter moved elsewhere is found."""
    torch = pytest.importorskip("torch", reason="torch not installed: torch round trip skipped")
    m = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    kept = torch.zeros(8)
    for step, shared in ((1, False), (2, False), (3, True), (4, True), (5, True)):
        if shared and step == 3:
            ck.share(m)
        m(torch.randn(3, 16)).sum().backward()
        opt.step()  # new values in the same memory
        if step == 5:
            m.bias.data = torch.full((4,), 9.0)  # a new tensor elsewhere (private memory): copied at save
        kept += step
        h = ck.save(step, {"model": m.state_dict(), "kept": kept, "step": step})
        h.wait_durable(30)
        back = ck.load(step)
        assert back["step"] == step and torch.equal(back["kept"], kept)
        for k, v in m.state_dict().items():
            assert torch.equal(back["model"][k], v), (step, k)
