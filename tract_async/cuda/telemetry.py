"""GPU telemetry: a pynvml sampler coroutine that keeps time series for benchmarks and plots.

Per sample: PCIe RX and TX throughput (``nvmlDeviceGetPcieThroughput``, KB/s over the driver's
20 ms window), SM and memory-controller utilization, memory used, power. NVML calls block
(the PCIe counter call for its whole window), so each sample runs in a worker thread and the
loop only awaits it. Where NVML is absent (no driver, no ``pynvml``), ``NvmlSampler`` is a no-op
whose ``available`` is False and whose series stay empty.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

FIELDS = ("t_s", "pcie_rx_mbs", "pcie_tx_mbs", "sm_util_pct", "mem_util_pct", "mem_used_mib",
          "power_w")


def _load_nvml() -> tuple[Any, str]:
    try:
        import pynvml
    except Exception as e:
        from tract_async.extras import INSTALL_HINT
        return None, f"pynvml not importable ({e}): {INSTALL_HINT}"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return None, f"nvmlInit failed: {e}"
    return pynvml, ""


class NvmlSampler:
    """Samples one GPU every ``interval_s`` while ``run()`` is running.

    ``series()`` returns column lists (``FIELDS``); at most ``max_samples`` are kept (oldest
    dropped). ``mark(name)`` stores an event time on the same clock, for timelines.
    """

    def __init__(self, device_index: int = 0, *, interval_s: float = 0.1,
                 max_samples: int = 100_000) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.device_index = device_index
        self.interval_s = interval_s
        self.max_samples = max_samples
        self._cols: dict[str, list[float]] = {f: [] for f in FIELDS}
        self.marks: list[tuple[float, str]] = []
        self.t0 = time.perf_counter()
        self._nvml, self.reason = _load_nvml()
        self._handle = None
        if self._nvml is not None:
            try:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(device_index)
            except Exception as e:
                self._nvml, self.reason = None, f"no NVML device {device_index}: {e}"
        self.errors = 0

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def mark(self, name: str) -> None:
        self.marks.append((self.now(), name))

    def sample_once(self) -> dict[str, float] | None:
        """One blocking sample (call from a thread), appended to the series; None if no NVML."""
        if self._nvml is None:
            return None
        n, h = self._nvml, self._handle
        row: dict[str, float] = {"t_s": self.now()}
        try:
            row["pcie_rx_mbs"] = n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES) / 1e3
            row["pcie_tx_mbs"] = n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES) / 1e3
            u = n.nvmlDeviceGetUtilizationRates(h)
            row["sm_util_pct"], row["mem_util_pct"] = float(u.gpu), float(u.memory)
            row["mem_used_mib"] = n.nvmlDeviceGetMemoryInfo(h).used / (1 << 20)
            row["power_w"] = n.nvmlDeviceGetPowerUsage(h) / 1e3
        except Exception:
            self.errors += 1
            return None
        for f in FIELDS:
            col = self._cols[f]
            col.append(row.get(f, float("nan")))
            if len(col) > self.max_samples:
                del col[0]
        return row

    async def run(self) -> None:
        """Sample until cancelled (a no-op loop that just waits when NVML is absent)."""
        if self._nvml is None:
            await asyncio.Event().wait()       # nothing to do; ends on cancellation
            return
        while True:
            t = time.perf_counter()
            await asyncio.to_thread(self.sample_once)
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - t)))

    def series(self) -> dict[str, list[float]]:
        return {f: list(c) for f, c in self._cols.items()}

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"available": self.available, "samples": len(self._cols["t_s"]),
                               "reason": self.reason or None, "errors": self.errors}
        for f in FIELDS[1:]:
            c = [x for x in self._cols[f] if x == x]
            if c:
                out[f"{f}_max"] = max(c)
                out[f"{f}_mean"] = sum(c) / len(c)
        return out
