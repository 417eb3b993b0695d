"""safetensors through the torch.save import hook (CKPT_SIDECAR=1).

Hugging Face libraries write weights with safetensors.torch.save_file /
save_model, not torch.save. _hook.install() also installs this: a finder
waits for `import safetensors.torch`, lets the real loader run, then
replaces the module's save_file and load_file (save_model calls the
module's save_file, so it is covered too; so is a `from safetensors.torch
import save_file` done after the import, the usual case).

- save_file(tensors, path, metadata) serialises with safetensors' own
  in-memory serialiser (safetensors.torch.save: the same header, order,
  padding and metadata as save_file, so the file's bytes are the ones the
  original writes) and hands the bytes to the torch.save hook's file path
  (_file_queue.files.submit): same guarantees (returns once the sidecar holds
  them, atomic and durable, written by this process when the sidecar cannot,
  files of one path in save order) and the same counters (_hook.counts()).
- Errors as the original's: what safetensors refuses (non-contiguous or
  shared tensors, bad metadata) it raises from its serialiser at call time;
  a path the hook cannot write atomically (missing directory, no
  permission, read-only file system, a directory or a device at the path)
  goes to the original save_file, which raises its own error (or writes as
  it always does); a write that failed after save_file returned is raised
  by the path's next save_file/load_file (or torch.save/torch.load), or
  makes the process exit 1 (see _hook).
- CUDA tensors take the host way: safetensors' serialiser copies them to
  the host in the trainer, then the sidecar writes the bytes (the sidecar's
  device copy serves torch.save only).
- Cost: safetensors' serialiser builds the whole file in memory (one copy of
  the tensors), copied once more into the shared memory the sidecar reads;
  the original writes straight from the tensors (and never fsyncs).
- load_file(path) of a path whose write is still pending waits for it.
"""

import os
import threading

from ._file_queue import files
from ._import_finder import mark_hooked, patch_when_imported
from ._paths import atomic_write_possible, is_path, target

MODULE = "safetensors.torch"
_installed = False
_mu = threading.Lock()
# save_file calls the hook took (through the sidecar or, failing that, this
# process: _hook.counts() says which) and those left to the original save_file.
_counts = {"hooked": 0, "original": 0}


def install():
    """Arrange that safetensors.torch.save_file/load_file go through the hook
    (now if the module is imported already, else when it is)."""
    global _installed
    if _installed:
        return
    _installed = True
    patch_when_imported(MODULE, patch)


def counts():
    """{"hooked": save_file calls the hook took, "original": calls left to
    the original save_file (a path it cannot write atomically, a file object)}."""
    with _mu:
        return dict(_counts)


def _count(what):
    with _mu:
        _counts[what] += 1


def patch(st):
    """Replace st.save_file / st.load_file by the hook's (idempotent)."""
    if getattr(st.save_file, "_ckpt_sidecar_hook", False):
        return
    orig_save_file, orig_load_file, serialize = st.save_file, st.load_file, st.save

    def save_file(tensors, filename, metadata=None):
        if not is_path(filename) or os.fsdecode(os.fspath(filename)).endswith(os.sep):
            _count("original")
            return orig_save_file(tensors, filename, metadata=metadata)
        path = target(filename)
        files.raise_error(path)
        if not atomic_write_possible(path):
            # Fails now, as the original's own error (after this path's
            # pending writes, so that files still land in save order).
            files.wait(path)
            _count("original")
            return orig_save_file(tensors, filename, metadata=metadata)
        data = serialize(tensors, metadata=metadata)  # safetensors' own checks and bytes
        files.submit(path, data)
        _count("hooked")

    def load_file(filename, *args, **kwargs):
        if is_path(filename):
            files.settle(target(filename))
        return orig_load_file(filename, *args, **kwargs)

    mark_hooked((save_file, orig_save_file), (load_file, orig_load_file))
    st.save_file, st.load_file = save_file, load_file
