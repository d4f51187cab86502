"""The ``rdma-model`` baseline: what a KV transfer over an RDMA NIC would take, as a model.

The paper's baseline is NIXL over RDMA (InfiniBand), which this machine does not have. Rather
than leave the baseline out, the ``rdma-model`` mode runs the real prefill (measured), moves the
KV through the region only as a carrier (salted keys, a lock-free cache-mode get), and holds its
arrival at the decode worker back until a modelled RDMA transfer of those bytes would have
finished:

    transfer_s = RDMA_LATENCY_S + nbytes / RDMA_BANDWIDTH_BPS

counted from the moment the decode worker starts fetching, which the router makes *after* the
prefill has answered (vLLM's NixlConnector pulls the KV once the prefill is done, in one
transfer request). The constants, and why:

* ``RDMA_BANDWIDTH_BPS`` = 25 GB/s: the payload rate of one 200 Gb/s HDR InfiniBand port
  (the paper's comparison point) is 25 GB/s at line rate; real READs of large KV come close to it,
  so this is a generous baseline (it assumes no NIC queueing and no host-buffer bounce).
* ``RDMA_LATENCY_S`` = 20 µs: one transfer's fixed cost: posting the READ work requests of all
  the request's descriptors, the first byte's round trip (~2-3 µs on ConnectX-6), completion
  polling, and the notification to the producer. Measured NIXL UCX figures for small transfers
  on loopback are 15-36 µs (README, transport bench), so 20 µs is at the low end.

Both are ``ServiceConfig`` fields (``--rdma-gbps``, ``--rdma-latency-us``) so a run can model
another NIC. When the carrier copy itself takes longer than the model (small transfers on a
loaded CPU: the model says ~0.1 ms, the event loop cannot wake that precisely), the arrival is
the real one: the row's KV load is then ``max(model, machine)``, and the decode worker records
both (events ``kv_model_due`` and ``kv_load_done``).
"""
from __future__ import annotations

import asyncio
import time

from tract_async.host.timerslack import tighten

#: Modelled RDMA bandwidth: one 200 Gb/s HDR InfiniBand port at line rate (bytes per second).
RDMA_BANDWIDTH_BPS: float = 25e9
#: Modelled fixed cost of one RDMA transfer (seconds).
RDMA_LATENCY_S: float = 20e-6


def transfer_s(nbytes: int, *, gbps: float = RDMA_BANDWIDTH_BPS / 1e9,
               latency_us: float = RDMA_LATENCY_S * 1e6) -> float:
    """Seconds the modelled NIC takes to move ``nbytes`` in one transfer.

    Raises:
        ValueError: a negative size, a non-positive bandwidth or a negative latency.
    """
    if nbytes < 0 or gbps <= 0 or latency_us < 0:
        raise ValueError(f"transfer_s needs nbytes >= 0, gbps > 0, latency_us >= 0; got "
                         f"{nbytes}, {gbps}, {latency_us}")
    return latency_us * 1e-6 + nbytes / (gbps * 1e9)


def _sleep_until_in_thread(deadline: float) -> None:
    tighten()   # 1 µs timer slack: the default 50 µs would be most of a small transfer's model
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


async def sleep_until(deadline: float) -> None:
    """Wait until ``time.monotonic()`` reaches ``deadline``, without blocking the loop.

    The event loop's timers round to milliseconds; the last millisecond is slept in a worker
    thread with a tight timer slack instead, so a 60 µs model is not rounded up to 1 ms.
    """
    while (left := deadline - time.monotonic()) > 0.002:
        await asyncio.sleep(left - 0.001)
    if deadline - time.monotonic() > 0:
        await asyncio.to_thread(_sleep_until_in_thread, deadline)
