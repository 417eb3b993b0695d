"""PyTorch Lightning: checkpoints through the sidecar.

    from lightning.pytorch import Trainer
    from ckpt_sidecar.lightning import SidecarCheckpointIO
    trainer = Trainer(plugins=[SidecarCheckpointIO()], ...)

SidecarCheckpointIO is a CheckpointIO plugin over the torch.save hook's file
path (_hook._files; CKPT_SIDECAR=1 is not needed): the sidecar at
$CKPT_SIDECAR_SOCKET (or the default socket) if one runs, else one spawned
for this process at the first save, as the hook does.

- save_checkpoint serialises the checkpoint with the original torch.save
  into shared memory and returns once the sidecar holds the bytes
  (Released): no thread of this process copies them again, unlike
  Lightning's AsyncCheckpointIO. The sidecar writes the file atomically and
  durably (temp, fsync, rename, directory fsync); where it cannot (none
  reachable, the file larger than its staging, it died), a thread of this
  process writes it the same way from the bytes it kept. Files are plain
  torch.save files at the path Lightning gave, so `ckpt_path=` and
  `torch.load` read them. CUDA tensors are copied to the host by
  torch.save in the trainer (the host way). Paths with an fsspec protocol
  other than the local file system go to Lightning's TorchCheckpointIO.
- load_checkpoint and remove_checkpoint wait for the path's pending write
  first: a checkpoint ModelCheckpoint's save_top_k removes is never
  renamed into place after its removal.
- teardown waits until every checkpoint saved through the hook is durable,
  and raises the first write that failed after its save returned (an
  OSError with its errno).
"""

import os

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError:  # the standalone lightning_fabric (pytorch_lightning's)
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning_fabric.utilities.cloud_io import get_filesystem

from . import _hook


def _local(path):
    return "://" not in str(path) or str(path).startswith("file://")


def save_torch(obj, path):
    """torch.save(obj, path) through the hook's file path: returns once the
    sidecar holds the bytes (or this process is to write them). What cannot
    be written atomically (see _hook._atomic_write_possible) is handed to
    the original torch.save, which raises its own error."""
    import torch

    orig = getattr(torch.save, "__wrapped__", torch.save)  # the original when the hook replaced it
    path = _hook._target(path)
    _hook._files.raise_error(path)
    if not _hook._atomic_write_possible(path):
        _hook._files.wait(path)
        return orig(obj, path)
    _hook.save_host(orig, obj, path)
    return None


class SidecarCheckpointIO(TorchCheckpointIO):
    """A Lightning CheckpointIO whose save returns once the sidecar holds the
    checkpoint (see the module's doc)."""

    def __init__(self):
        super().__init__()
        self._paths = set()  # paths saved here, for teardown's error check

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`."
            )
        if not _local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = os.fspath(path)
        if path.startswith("file://"):
            path = path[len("file://") :]
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        save_torch(checkpoint, path)
        self._paths.add(_hook._target(path))
        return None

    def _settle(self, path):
        """Waits for `path`'s pending write; its failure, if any, raised."""
        if _local(path):
            _hook._files.settle(_hook._target(str(path).removeprefix("file://")))

    def load_checkpoint(self, path, *args, **kwargs):  # map_location, weights_only (Lightning >= 2.6)
        self._settle(path)
        return super().load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path):
        if _local(path):
            target = _hook._target(str(path).removeprefix("file://"))
            _hook._files.wait(target)  # never renamed into place after its removal
            _hook._files.take_error(target)  # a lost file that is being removed anyway
            self._paths.discard(target)
        return super().remove_checkpoint(path)

    def teardown(self):
        _hook._files.wait(None)
        for path in sorted(self._paths):
            _hook._files.raise_error(path)
        self._paths.clear()
        return super().teardown()
