"""Registering the region mapping with CUDA (``cudaHostRegister``), and the fallback.

Registered (portable | mapped), the mapping is page-locked and visible to every context of the
process: ``cudaMemcpyAsync`` moves bytes between it and device memory by DMA at pinned speed
(``notes/h200-ceilings.md``: 55 GB/s each way on the H200, the same as ``cudaMallocHost``), and a
kernel can load or store it directly through its device address (zero-copy over PCIe). With
unified addressing (every 64-bit Linux system CUDA supports) the device address is the host
address, which is what the copy code relies on; ``device_pointer()`` checks it.

Registration is per mapping, once per process (two Engines attaching the same file have two
mappings, each registered). It is undone by ``close()``, which must run before the mapping is
unmapped: ``Engine`` does so in its teardown.

If registration fails (no permission to lock that much memory, an old driver, a file system the
driver refuses), the engine falls back to a pinned staging buffer: bytes then cross the host
twice (DMA to the pinned buffer, a CPU copy to the region). ``stats()["cuda"]`` says which.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from typing import Any

import numpy as np

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2
CUDA_MEMCPY_DEFAULT = 4

ENV_NO_REGISTER = "TRACT_CUDA_NO_REGISTER"
"""Set to 1 to skip registration (tests the pinned-staging fallback)."""


def _err_code(err: Any) -> int:
    """torch's cudart binding returns a pybind enum; ctypes an int."""
    try:
        return int(err)
    except TypeError:
        return int(getattr(err, "value", 1))


class HostRegistration:
    """The registered region: ``tensor`` is a CPU uint8 tensor over the whole mapping, page-locked
    and mapped for the device; ``registered`` False means the fallback is in use (``reason``)."""

    def __init__(self, buf: np.ndarray) -> None:
        import torch
        self.buf = buf
        self.tensor = torch.from_numpy(buf)          # shares the mapping, no copy
        self.ptr = int(buf.ctypes.data)
        self.nbytes = int(buf.nbytes)
        self.registered = False
        self.reason = ""
        self.seconds = 0.0
        if os.environ.get(ENV_NO_REGISTER, "") not in ("", "0"):
            self.reason = f"{ENV_NO_REGISTER} is set"
            return
        import time
        t0 = time.perf_counter()
        try:
            cudart = torch.cuda.cudart()
            err = _err_code(cudart.cudaHostRegister(
                self.ptr, self.nbytes, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED))
        except Exception as e:  # no binding, no driver: the fallback says why
            self.reason = f"cudaHostRegister unavailable: {e}"
            return
        self.seconds = time.perf_counter() - t0
        if err != 0:
            self.reason = f"cudaHostRegister failed with cudaError {err}"
            # clear the sticky last-error so that later calls do not report it
            try:
                torch.cuda.cudart().cudaGetLastError()  # type: ignore[attr-defined]
            except Exception:
                pass
            return
        self.registered = True

    def device_pointer_matches(self) -> bool:
        """True if the device address of the mapping equals its host address (UVA)."""
        if not self.registered:
            return False
        lib = cudart_lib()
        if lib is None:
            return True  # cannot ask; UVA is the rule on every supported 64-bit platform
        dptr = ctypes.c_void_p()
        err = lib.cudaHostGetDevicePointer(ctypes.byref(dptr), ctypes.c_void_p(self.ptr), 0)
        return err == 0 and dptr.value == self.ptr

    def close(self) -> None:
        """Unregister (idempotent). Must run before the mapping is unmapped."""
        if not self.registered:
            return
        self.registered = False
        import torch
        err = _err_code(torch.cuda.cudart().cudaHostUnregister(self.ptr))
        if err != 0:
            raise AssertionError(f"cuda.hostreg: cudaHostUnregister of the region mapping "
                                 f"failed with cudaError {err}")

    def describe(self) -> dict[str, Any]:
        return {"registered": self.registered, "fallback": None if self.registered else
                "pinned-staging", "reason": self.reason, "register_s": round(self.seconds, 4),
                "bytes": self.nbytes}


_CUDART: Any = None
_CUDART_TRIED = False


def cudart_lib() -> Any:
    """libcudart through ctypes (the one torch already loaded), or None. Used for what torch does
    not bind: ``cudaMemcpy2DAsync``, ``cudaHostGetDevicePointer``."""
    global _CUDART, _CUDART_TRIED
    if _CUDART_TRIED:
        return _CUDART
    _CUDART_TRIED = True
    names: list[str] = []
    try:
        import torch
        ver = (torch.version.cuda or "").split(".")[0]
        if ver:
            names.append(f"libcudart.so.{ver}")
    except Exception:
        pass
    names.append("libcudart.so")
    try:
        import torch
        root = os.path.dirname(os.path.dirname(torch.__file__))
        names += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"),
                                  recursive=True))
    except Exception:
        pass
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            f = lib.cudaMemcpy2DAsync
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            g = lib.cudaHostGetDevicePointer
            g.restype = ctypes.c_int
            g.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
        except AttributeError:
            continue
        _CUDART = lib
        break
    return _CUDART


def memcpy2d_async(dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                   stream_handle: int) -> None:
    """``cudaMemcpy2DAsync`` (kind: default, UVA). Raises RuntimeError if it fails or libcudart
    is not reachable."""
    lib = cudart_lib()
    if lib is None:
        raise RuntimeError("libcudart not found through ctypes: no 2-D copies")
    err = lib.cudaMemcpy2DAsync(ctypes.c_void_p(dst), dpitch, ctypes.c_void_p(src), spitch,
                                width, height, CUDA_MEMCPY_DEFAULT, ctypes.c_void_p(stream_handle))
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with cudaError {err} (dst={dst:#x} "
                           f"dpitch={dpitch} src={src:#x} spitch={spitch} width={width} "
                           f"height={height})")
