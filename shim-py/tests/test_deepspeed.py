"""DeepSpeed's engine checkpoints (engine.save_checkpoint) through the
torch.save import hook, on DeepSpeed's CPU accelerator: its default
checkpoint engine calls torch.save, so the hook carries the files to the
sidecar with no change to DeepSpeed; a fresh engine loads them back."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="torch not installed: DeepSpeed needs it")

SCRIPT = r'''
import json, os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
import torch, deepspeed, deepspeed.ops
from ckpt_sidecar import _hook
# World size 1 needs no shared-memory collective: skip its JIT build (ninja, minutes).
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
out = sys.argv[1]
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
deepspeed.init_distributed(dist_backend="gloo")

def engine(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return deepspeed.initialize(model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.01), config=cfg)[0]

e = engine(0)
x = torch.randn(4, 8)
for _ in range(5):
    e.backward(torch.nn.functional.mse_loss(e(x), x.sum(1, keepdim=True)))
    e.step()
e.save_checkpoint(out, tag="step5")
_hook.flush()
e2 = engine(1)
e2.load_checkpoint(out, tag="step5")
same = all(torch.equal(a, b) for a, b in zip(e.module.state_dict().values(), e2.module.state_dict().values()))
print(json.dumps({"counts": _hook.counts(), "loaded_equal": same, "global_steps": e2.global_steps}))
'''


def test_deepspeed_engine_save_checkpoint_goes_through_the_hook_on_cpu(tmp_path, sidecar):
    pytest.importorskip("deepspeed", reason="deepspeed not installed (opt-in: .ci/test-deepspeed installs it)")
    import socket

    with socket.socket() as s:  # a free port for gloo's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_SIDECAR")}
    env.update(CKPT_SIDECAR="1", CKPT_SIDECAR_SOCKET=sidecar.socket, PYTHONWARNINGS="ignore")
    script = tmp_path / "ds.py"
    script.write_text(textwrap.dedent(SCRIPT))
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(port)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    told = json.loads(r.stdout.strip().splitlines()[-1])
    # mp_rank_00_model_states.pt (model, optimizer, engine state), placed by
    # the hook; `latest` DeepSpeed writes with open(), not torch.save.
    assert told["counts"] == {"sidecar": 0, "in_process": 1, "superseded": 0}, told
    assert told["loaded_equal"] and told["global_steps"] == 5, told
    assert (tmp_path / "out" / "step5" / "mp_rank_00_model_states.pt").is_file()
