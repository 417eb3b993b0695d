"""ckpt_sidecar.lightning.SidecarCheckpointIO with a real Lightning Trainer on
CPU: checkpoints every 5 steps, in place when save_checkpoint returns and
synced off the trainer's thread, `last.ckpt` read by
plain torch.load, ModelCheckpoint's top-k removals, and a run SIGKILLed
right after a save and resumed with ckpt_path="last" ending with the weights
of an uninterrupted run."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: Lightning needs it")
pytest.importorskip("lightning", reason="lightning not installed (.ci/setup-test-python.sh installs it)")

TRAINER = r'''
import os, sys, json
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from ckpt_sidecar.lightning import SidecarCheckpointIO

mode, out = sys.argv[1], sys.argv[2]          # full | kill | resume, output folder
KILL_AT = 10                                   # the step whose last.ckpt save is followed by SIGKILL


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    steps_run = 0

    def training_step(self, batch, batch_idx):
        Model.steps_run += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class KillAfterSave(SidecarCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        if mode == "kill" and checkpoint["global_step"] == KILL_AT and str(path).endswith("last.ckpt"):
            os.kill(os.getpid(), 9)                # right after save_checkpoint returned


L.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
x = torch.randn(20, 4, generator=g)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)   # 5 steps per epoch
model = Model()
ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=5, save_last=True, save_top_k=1)
trainer = L.Trainer(max_steps=20, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, callbacks=[ckpt], plugins=[KillAfterSave()])
trainer.fit(model, loader, ckpt_path="last" if mode == "resume" else None)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
print(json.dumps({"global_step": trainer.global_step, "steps_run": Model.steps_run, "files": sorted(os.listdir(os.path.join(out, "ckpt")))}))
'''


def _trainer(tmp_path, mode, out, sidecar):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env["CKPT_SIDECAR_SOCKET"] = sidecar.socket
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run([sys.executable, str(script), mode, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)


def _state_dict(ckpt_file):
    return torch.load(ckpt_file, weights_only=False)["state_dict"]


def test_lightning_trainer_checkpoints_and_last_ckpt_loads_with_plain_torch_load(tmp_path, sidecar):
    out = tmp_path / "full"
    r = _trainer(tmp_path, "full", out, sidecar)
    assert r.returncode == 0, r.stderr
    told = json.loads(r.stdout.strip().splitlines()[-1])
    assert (told["global_step"], told["steps_run"]) == (20, 20), told
    # save_top_k=1: the older step checkpoints were removed, and stay so.
    assert told["files"] == ["epoch=3-step=20.ckpt", "last.ckpt"], told
    assert sorted(os.listdir(out / "ckpt")) == told["files"]
    assert "ckpt_sidecar:" not in r.stderr, r.stderr  # no removed checkpoint reported as a loss
    last = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)  # plain torch.load: no hook here
    assert last["global_step"] == 20
    final = torch.load(out / "final.pt")
    sd = last["state_dict"]
    assert sd.keys() == final.keys()
    for k in final:
        assert torch.equal(sd[k], final[k]), k


def test_lightning_sigkill_after_save_then_resume_from_last_equals_an_uninterrupted_run(tmp_path, sidecar):
    full, broken = tmp_path / "full", tmp_path / "broken"
    r = _trainer(tmp_path, "full", full, sidecar)
    assert r.returncode == 0, r.stderr
    r = _trainer(tmp_path, "kill", broken, sidecar)
    assert r.returncode == -9, r.stdout + r.stderr
    # last.ckpt of step 10 was in place when save_checkpoint returned.
    assert torch.load(broken / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 10
    r = _trainer(tmp_path, "resume", broken, sidecar)
    assert r.returncode == 0, r.stderr
    told = json.loads(r.stdout.strip().splitlines()[-1])
    assert (told["global_step"], told["steps_run"]) == (20, 10), told  # resumed at step 10, not from scratch
    a, b = torch.load(full / "final.pt"), torch.load(broken / "final.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _state_dict(broken / "ckpt" / "last.ckpt").keys() == _state_dict(full / "ckpt" / "last.ckpt").keys()
