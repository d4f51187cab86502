"""Keep this repository's ``kernels/`` folder from shadowing Hugging Face's ``kernels`` package.

Our kernels install as ``tract_kernels``, but their source folder is ``kernels/`` (the project's
layout). Wherever the repository root is on ``sys.path`` (pytest's ``pythonpath``, ``python -m``
run from the root, spawned workers that inherit that path), ``import kernels`` finds that folder
first. transformers >= 5.25 requires Hugging Face's ``kernels`` and imports it when its
distribution is installed (``integrations/hub_kernels.py``): it then got our folder and failed
with ``ImportError: cannot import name 'CUDAProperties' from 'kernels'`` (a CI run of
2026-12-03, on the first test module that imports transformers).

``install()`` puts a finder first on ``sys.meta_path`` that resolves the top-level name
``kernels`` along ``sys.path`` skipping every entry whose ``kernels`` is ours (recognised by its
docstring). Where no other ``kernels`` exists it answers nothing, and imports behave as before.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Sequence

_MARK = "tract_kernels: "


def _is_ours(origin: str | None) -> bool:
    if not origin or os.path.basename(origin) != "__init__.py":
        return False
    try:
        with open(origin, encoding="utf-8") as f:
            return _MARK in f.read(400)
    except OSError:
        return False


class _OthersKernelsFirst(importlib.abc.MetaPathFinder):
    """``kernels`` from the first ``sys.path`` entry whose ``kernels`` is not this project's."""

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != "kernels" or path is not None:
            return None
        for entry in list(sys.path):
            spec = importlib.machinery.PathFinder.find_spec(name, [entry])
            if spec is not None and not _is_ours(spec.origin):
                return spec
        return None


def install() -> None:
    """Idempotent."""
    if not any(isinstance(f, _OthersKernelsFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _OthersKernelsFirst())
