"""Patching a module when it is imported: a finder first on sys.meta_path
that finds nothing itself but wraps the loader of whoever finds the module,
so that a patch runs right after the module's own code (torch for the
torch.save hook, safetensors.torch for its save_file)."""

import importlib.abc
import sys


class _LoaderWrapper(importlib.abc.Loader):
    """Loads a module as its own loader does, then patches it."""

    def __init__(self, inner, patch):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of whoever finds module `name`,
    so that `patch(module)` runs once the module is imported (torch here,
    safetensors.torch in _hook_safetensors)."""

    def __init__(self, name, patch):
        self._name = name
        self._patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self._name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderWrapper(spec.loader, self._patch)
                return spec
        return None


def mark_hooked(*pairs):
    """Each (hook, original) pair: the hook marked as ours (patch is then
    idempotent), wrapping the original, under its name and doc."""
    for fn, orig in pairs:
        fn._ckpt_sidecar_hook = True
        fn.__wrapped__ = orig
        fn.__doc__ = orig.__doc__
        fn.__name__ = orig.__name__


def patch_when_imported(name, patch):
    """`patch(module)` now if module `name` is imported already, else when it is."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, PatchingFinder(name, patch))
