"""safetensors through the torch.save import hook (CKPT_SIDECAR=1).

Hugging Face libraries write weights with safetensors.torch.save_file /
save_model, not torch.save. _hook.install() also installs this: a finder
waits for `import safetensors.torch`, lets the real loader run, then
replaces the module's save_file and load_file (save_model calls the
module's save_file, so it is covered too; so is a `from safetensors.torch
import save_file` done after the import, the usual case).

- save_file(tensors, path, metadata) runs the original save_file (its own
  checks, bytes and speed) into the hook's named temp file beside the path
  (.NAME.ckpt-tmp-PID-HEX, flock'ed), which is renamed over the path
  before save_file returns; the file and directory fsyncs follow on the
  hook's thread (_file_queue): the same guarantees and counters as
  torch.save's (_hook.counts()). A named temp, not an unnamed one: recent
  safetensors write a temp file of their own beside the name they are
  given and rename it over that name, which /proc/self/fd cannot take. A
  kill during the write leaves our temp (swept by the next hooked save
  into the directory) or safetensors' own (as the original leaves it).
- Errors as the original's: what safetensors refuses (non-contiguous or
  shared tensors, bad metadata) it raises at call time, and the path keeps
  its old file; a path the hook cannot write atomically (missing
  directory, no permission, read-only file system, a directory or a device
  at the path) goes to the original save_file, which raises its own error
  (or writes as it always does); a sync that failed after save_file
  returned is raised by the path's next save_file/load_file (or
  torch.save/torch.load), or makes the process exit 1 (see _hook).
- CUDA tensors are copied to the host by safetensors, as the original does.
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
    orig_save_file, orig_load_file = st.save_file, st.load_file

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
        files.sweep_once(os.path.dirname(path))

        def fill(_fd, name):
            orig_save_file(tensors, name, metadata=metadata)  # its own checks, bytes and speed

        files.write_here(path, fill, by_name=True)
        _count("hooked")

    def load_file(filename, *args, **kwargs):
        if is_path(filename):
            files.settle(target(filename))
        return orig_load_file(filename, *args, **kwargs)

    mark_hooked((save_file, orig_save_file), (load_file, orig_load_file))
    st.save_file, st.load_file = save_file, load_file
