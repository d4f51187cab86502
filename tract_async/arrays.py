"""KV arrays without a hard dependency on torch: torch tensors where torch is installed, numpy
arrays everywhere.

Why: the core library (region, lock, allocator, index, the engine over a region, the HTTP
transport, the region tools) installs in about 330 MB, and CPU torch alone adds about 880 MB. A
router, an operator's box that runs ``tract region fsck``, or a process that holds its KV as
numpy arrays needs no torch. So the core accepts either kind of array and imports torch only
where it is installed and used:

* a torch tensor (CPU, or CUDA on a CUDA build): what vLLM and the serving stack pass;
* a C-contiguous numpy array of the layout's *storage* dtype: float32 and float16 as themselves,
  bfloat16 as uint16 and the float8 types as uint8 (numpy has no such types; the bits are the
  same, so ``tensor.view(torch.uint16).numpy()`` of a bfloat16 tensor is such an array).

``get_kv`` without ``out`` returns a torch tensor where torch is installed, else a numpy array.
What needs torch (CUDA tensors, the network stores' pools, the serving stack) raises
``MissingExtra`` with the install line.

No torch import happens here until a caller needs one: ``is_tensor`` looks in ``sys.modules``
(an object cannot be a torch tensor unless torch was imported), so the numpy path never pays
torch's import time either.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import numpy as np

from .errors import ConfigError, MissingExtra

ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                            "float8_e5m2": 1}
"""Bytes per element of each KV dtype a layout may name (torch's names, without ``torch.``)."""

DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE)

NUMPY_STORAGE: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16), "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8)}
"""The numpy dtype that holds each KV dtype's bits."""

TORCH_INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
                 "(the CPU build; a CUDA build from pytorch.org for GPUs), or the 'torch' extra: "
                 "pip install 'tract-async[torch]'")


@functools.cache
def torch_installed() -> bool:
    """Is torch importable here (found without importing it)?"""
    return importlib.util.find_spec("torch") is not None


def require_torch(purpose: str) -> ModuleType:
    """torch, for ``purpose``; MissingExtra with the install line where it is not installed."""
    if not torch_installed():
        raise MissingExtra(f"{purpose} needs torch, which the core install leaves out: "
                           f"{TORCH_INSTALL}")
    return importlib.import_module("torch")


def is_tensor(x: object) -> bool:
    """Is ``x`` a torch tensor? (No import: without a loaded torch nothing is one.)"""
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


def is_cuda(x: object) -> bool:
    return is_tensor(x) and bool(x.is_cuda)  # type: ignore[attr-defined]


def dtype_name(dt: object) -> str:
    """The KV dtype name of a torch dtype, a numpy-free name string, or raise ConfigError."""
    if isinstance(dt, str):
        name = dt.removeprefix("torch.")
    elif type(dt).__module__ == "torch" and type(dt).__name__ == "dtype":
        name = str(dt).removeprefix("torch.")
    else:
        name = ""
    if name not in ITEMSIZE:
        raise ConfigError(f"KVLayout.dtype must be one of {sorted(DTYPE_NAMES)} (a torch dtype "
                          f"or its name), got {dt!r}")
    return name


def layout_dtype(name: str) -> Any:
    """What ``KVLayout.dtype`` holds for ``name``: the torch dtype where torch is installed (the
    serving stack builds tensors with it), else the name."""
    t = sys.modules.get("torch")
    if t is None:
        if not torch_installed():
            return name
        t = importlib.import_module("torch")
    return getattr(t, name)


def array_dtype_ok(a: object, name: str) -> bool:
    """Does array ``a`` (torch or numpy) hold KV of dtype ``name``?"""
    if is_tensor(a):
        return str(a.dtype).removeprefix("torch.") == name  # type: ignore[attr-defined]
    return isinstance(a, np.ndarray) and a.dtype == NUMPY_STORAGE[name]


def array_dtype_str(a: object) -> str:
    return str(getattr(a, "dtype", type(a).__name__))


def device_type(a: object) -> str:
    """"cpu", "cuda", ... of a tensor; "cpu" for numpy arrays."""
    return a.device.type if is_tensor(a) else "cpu"  # type: ignore[attr-defined]


def is_contiguous(a: object) -> bool:
    if is_tensor(a):
        return bool(a.is_contiguous())  # type: ignore[attr-defined]
    return bool(a.flags.c_contiguous)  # type: ignore[attr-defined]


def contiguous(a: Any) -> Any:
    """``a`` itself where it is contiguous, else a contiguous copy."""
    if is_tensor(a):
        return a.contiguous()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def data_ptr(a: Any) -> int:
    """The address of a contiguous array's first byte."""
    if is_tensor(a):
        return int(a.data_ptr())
    return int(a.__array_interface__["data"][0])


def is_array(a: object) -> bool:
    return is_tensor(a) or isinstance(a, np.ndarray)


def empty(shape: tuple[int, ...], name: str, *, device: Any = None) -> Any:
    """A new KV array: a torch tensor where torch is installed (on ``device``, default CPU),
    else a numpy array of the storage dtype (CPU only)."""
    if torch_installed():
        return importlib.import_module("torch").empty(
            shape, dtype=layout_dtype(name), device=device if device is not None else "cpu")
    if device is not None and str(device) != "cpu":
        require_torch(f"a KV array on device {device!r}")
    return np.empty(shape, dtype=NUMPY_STORAGE[name])

