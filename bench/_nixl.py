"""Shared NIXL helpers for the benchmarks: environment, agents, and a two-process handoff.

The settings, which ``bench/transport.py`` uses too: UCX on loopback only (``UCX_NET_DEVICES=lo``,
InfiniBand modules off), the NIXL progress thread off (each side progresses its own worker by
polling), DRAM to DRAM. ``UCX_TLS`` picks the transport: ``"tcp"``, or ``"shm,cma,tcp"`` for
shared memory (NIXL asks UCX for peer error handling, which the pure shm transports lack, so UCX
is given tcp for the lanes shm cannot serve; see transport.py).

Handoff (``handoff``): the faithful NIXL equivalent of "producer put_kv, consumer's waiting get_kv
returns" is a WRITE with a notification: the producer pushes its buffer into the consumer's
registered memory and the consumer, busy-polling ``get_new_notifs`` (progress thread off, so its
poll is also what progresses its worker), observes the notification, which NIXL delivers only after
the data has landed. A READ by the consumer would need a second message first (the producer telling
the consumer the data is ready) and so is slower; WRITE+notification is the stronger baseline.
The transfer handle is built once per size, outside the timing (a repeat transfer re-posts it with
a new notification message): again the strongest form of the baseline.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import _procs

ENV = {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib", "UCX_LOG_LEVEL": "error",
       "NIXL_LOG_LEVEL": "WARN"}


def nixl_env(tls: str) -> None:
    """Set the UCX/NIXL environment (before nixl is imported in this process). On a host with a
    CUDA device ``cuda_copy`` is appended: NIXL's UCX backend refuses to start there without it
    (the buffers stay in DRAM; cuda_copy is never picked for host-to-host)."""
    if "cuda_copy" not in tls and os.path.exists("/dev/nvidiactl"):
        tls += ",cuda_copy"
    os.environ.update({**ENV, "UCX_TLS": tls})


def available() -> str | None:
    """None when nixl imports, else the reason it does not."""
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason goes into the report
        return f"nixl is not importable ({type(e).__name__}: {e}); pip install --no-deps nixl nixl-cu12"
    return None


def version() -> str | None:
    try:
        from importlib.metadata import version as v
        return v("nixl")
    except Exception:  # noqa: BLE001
        return None


def make_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread."""
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


# -- two-process handoff: producer WRITEs with a notification, consumer polls for it -------------
# ``cases``: list of (label, nbytes, count, warm, delay_s). Per handoff i the consumer says it is
# waiting, the producer sleeps delay_s (the consumer has been waiting that long), stamps t0 =
# perf_counter_ns() (CLOCK_MONOTONIC: one clock for both processes), posts the WRITE and polls it
# to completion; the consumer stamps t1 when the notification is seen and checks the last byte.


def _consume(max_bytes: int, cases: list, conn: Connection) -> dict[str, list[int]]:
    import numpy as np
    agent = make_agent("consumer")
    dst = np.zeros(max_bytes, dtype=np.uint8)
    reg = agent.register_memory([(dst.ctypes.data, max_bytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), dst.ctypes.data))
    agent.add_remote_agent(conn.recv())
    out: dict[str, list[int]] = {}
    for label, nbytes, count, warm, _delay in cases:
        t1s = []
        for i in range(warm + count):
            want = f"{label}:{i}".encode()
            conn.send(i)
            seen = False
            while not seen:
                for msgs in agent.get_new_notifs().values():
                    if want in msgs:
                        seen = True
            t1 = time.perf_counter_ns()
            if dst[nbytes - 1] != (i & 0xFF) or dst[0] != (i & 0xFF):
                raise RuntimeError(f"{label} handoff {i}: notification before the data")
            if i >= warm:
                t1s.append(t1)
        out[label] = t1s
    agent.deregister_memory(reg)
    return out


def _produce(max_bytes: int, cases: list, conn: Connection) -> dict[str, list[int]]:
    import numpy as np
    agent = make_agent("producer")
    src = np.full(max_bytes, 0x5A, dtype=np.uint8)
    reg = agent.register_memory([(src.ctypes.data, max_bytes, 0, "")], "DRAM")
    md, dst_addr = conn.recv()
    peer = agent.add_remote_agent(md)
    conn.send(agent.get_agent_metadata())
    out: dict[str, list[int]] = {}
    for label, nbytes, count, warm, delay in cases:
        local = agent.get_xfer_descs([(src.ctypes.data, nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(dst_addr, nbytes, 0)], "DRAM")
        h = None
        deadline = time.monotonic() + 60
        while h is None:  # the remote metadata may take a moment to be usable
            try:
                h = agent.initialize_xfer("WRITE", local, remote, peer, b"")
            except Exception:  # noqa: BLE001
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        t0s = []
        for i in range(warm + count):
            conn.recv()
            src[0] = src[nbytes - 1] = i & 0xFF
            if delay:
                time.sleep(delay)
            t0 = time.perf_counter_ns()
            state = agent.transfer(h, f"{label}:{i}".encode())
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL WRITE of {nbytes} bytes: {state}")
            if i >= warm:
                t0s.append(t0)
        agent.release_xfer_handle(h)
        out[label] = t0s
    agent.deregister_memory(reg)
    return out


def _consumer(tls: str, max_bytes: int, cases: list, conn: Connection, res: Connection) -> None:
    """Polls for each WRITE's notification and stamps t1 (the environment first: nixl reads it
    when it is imported)."""
    nixl_env(tls)
    _procs.send_outcome(res, lambda: _consume(max_bytes, cases, conn))


def _producer(tls: str, max_bytes: int, cases: list, conn: Connection, res: Connection) -> None:
    """Stamps t0 and WRITEs each handoff once the consumer says it waits."""
    nixl_env(tls)
    _procs.send_outcome(res, lambda: _produce(max_bytes, cases, conn))


def handoff(tls: str, cases: list, timeout_s: float = 300.0) -> dict[str, list[float]] | str:
    """Handoff seconds per case label (t1 - t0, samples), or a string saying why NIXL did not run."""
    why = available()
    if why:
        return why
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_c, res_c_child = ctx.Pipe(duplex=False)
    res_p, res_p_child = ctx.Pipe(duplex=False)
    max_bytes = max(c[1] for c in cases)
    cons = ctx.Process(target=_consumer, args=(tls, max_bytes, cases, a, res_c_child), daemon=True)
    prod = ctx.Process(target=_producer, args=(tls, max_bytes, cases, b, res_p_child), daemon=True)
    cons.start()
    prod.start()
    try:
        got = _procs.gather({"consumer": res_c, "producer": res_p}, timeout_s,
                            f"NIXL ({tls}) handoff")
        if isinstance(got, str):
            return got
        t1, t0 = got["consumer"], got["producer"]
        return {k: [(x1 - x0) / 1e9 for x0, x1 in zip(t0[k], t1[k])] for k in t0}
    finally:
        _procs.reap((prod, cons), 10)
