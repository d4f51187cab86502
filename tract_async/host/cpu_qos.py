"""A PM QoS request on ``/dev/cpu_dma_latency``: idle cores stay out of deep C-states.

Why. A consumer that sleeps in its event loop's selector (a doorbell wait, ``stores/doorbell.py``)
is woken by the kernel, and the core it wakes on must first leave its idle state. On the 16-core
H200 host that exit dominated the wake-up: a bare datagram wake-up between two processes took
152 us p50 with idle cores, against 47 us when another thread kept the core busy
(``bench/wakeup.py``); on the 2-core VM a 0 us request took the bare wake-up from 57 to 32 us.
Latency-sensitive serving (and ``tuned``'s latency-performance profile) holds such a request; it
costs idle power on every core of the host, so it is opt-in: ``EngineConfig.cpu_wake_latency_us``.

The kernel honours the request while the file stays open (any process's; the lowest value wins)
and drops it when the file is closed, also when the process dies, so nothing outlives the
engine. Opening needs root (or a udev rule that grants the file); without it a warning is logged
once and the engine runs on the host's own idle policy.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("tract_async.host.cpu_qos")

PATH = "/dev/cpu_dma_latency"


class CpuLatencyRequest:
    """Hold ``latency_us`` (0 = shallowest idle states only) while ``held``."""

    def __init__(self, latency_us: int, path: str = PATH) -> None:
        if not isinstance(latency_us, int) or isinstance(latency_us, bool) or latency_us < 0:
            raise ValueError(f"latency_us must be an int >= 0, got {latency_us!r}")
        self.latency_us = latency_us
        self.path = path
        self._fd: int | None = None
        self.why_not = ""
        """Why the request could not be made (empty while held, or before ``acquire``)."""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Make the request; False (and a warning) where the file cannot be opened or written."""
        if self._fd is not None:
            return True
        fd = None
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, self.latency_us.to_bytes(4, "little"))
        except OSError as e:
            if fd is not None:
                os.close(fd)
            self.why_not = f"{type(e).__name__}: {e}"
            log.warning("cpu_wake_latency_us=%d not applied: cannot write %s (%s); waits wake "
                        "at the host's idle-state latency", self.latency_us, self.path,
                        self.why_not)
            return False
        self._fd, self.why_not = fd, ""
        return True

    def release(self) -> None:
        """Drop the request. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> "CpuLatencyRequest":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
