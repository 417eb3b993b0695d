"""PyTorch Lightning: checkpoints through the sidecar.

    from lightning.pytorch import Trainer
    from ckpt_sidecar.lightning import SidecarCheckpointIO
    trainer = Trainer(plugins=[SidecarCheckpointIO()], ...)

SidecarCheckpointIO is a CheckpointIO plugin over the torch.save hook's file
path (_file_queue.files; CKPT_SIDECAR=1 is not needed), with its guarantees:

- save_checkpoint serialises the checkpoint with the original torch.save
  straight into an unnamed file of the target directory and renames it
  over the path before it returns: the path then names the complete new
  checkpoint for every reader. The file's and the directory's fsyncs run
  on a thread of this process afterwards, so the trainer does not wait for
  the disk (Lightning's TorchCheckpointIO never fsyncs). Files are plain
  torch.save files at the path Lightning gave, so `ckpt_path=` and
  `torch.load` read them. Paths with an fsspec protocol other than the
  local file system go to Lightning's TorchCheckpointIO.
- remove_checkpoint removes at once: nothing renames a file into place
  after its save returned, and a checkpoint removed before its fsync is no
  loss (its fsync is skipped, never reported).
- teardown waits until every checkpoint saved through the hook is durable,
  and raises the first sync that failed after its save returned (an
  OSError with its errno).
"""

from __future__ import annotations

import os
from typing import Any

try:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError:  # the standalone lightning_fabric (pytorch_lightning's)
    from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from ._file_queue import files, save_host
from ._paths import atomic_write_possible, target


def _local(path):
    return "://" not in str(path) or str(path).startswith("file://")


def save_torch(obj: Any, path: str | os.PathLike[str]) -> None:
    """torch.save(obj, path) through the hook's file path: returns once the
    file is in place under `path` (its fsync follows). What cannot
    be written atomically (see _paths.atomic_write_possible) is handed to
    the original torch.save, which raises its own error."""
    import torch

    orig = getattr(torch.save, "__wrapped__", torch.save)  # the original when the hook replaced it
    path = target(path)
    files.raise_error(path)
    if not atomic_write_possible(path):
        files.wait(path)
        orig(obj, path)
        return
    files.sweep_once(os.path.dirname(path))
    save_host(orig, obj, path)


class SidecarCheckpointIO(TorchCheckpointIO):
    """A Lightning CheckpointIO whose save returns once the checkpoint is in
    place, and makes it durable off the trainer's thread (see the module's doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._paths: set[str] = set()  # paths saved here, for teardown's error check

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
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
        self._paths.add(target(path))
        return None

    def _settle(self, path: Any) -> None:
        """An earlier sync's failure of `path`, if any, raised."""
        if _local(path):
            files.settle(target(str(path).removeprefix("file://")))

    def load_checkpoint(
        self, path: Any, *args: Any, **kwargs: Any
    ) -> Any:  # map_location, weights_only (Lightning >= 2.6)
        self._settle(path)
        return super().load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        if _local(path):
            done = target(str(path).removeprefix("file://"))
            files.take_error(done)  # a file that is being removed anyway
            self._paths.discard(done)
        return super().remove_checkpoint(path)

    def teardown(self) -> None:
        files.wait(None)
        for path in sorted(self._paths):
            files.raise_error(path)
        self._paths.clear()
        return super().teardown()
