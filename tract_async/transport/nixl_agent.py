"""NIXL as a network transport: an asyncio face on a real NIXL agent (``nixl._api``, UCX).

The aiohttp Agent (``transport.http``) is NIXL-*style*: the same concepts in Python over HTTP.
This module drives NIXL itself, so that bytes between racks move through UCX (TCP here; RDMA,
cuda_copy / GPUDirect where the fabric has them) instead of through Python. It keeps the
conventions of the HTTP agent so that a store can use either:

* descriptors are ``XferDescList`` rows ``(addr, nbytes, dev_id)``, memory is registered through
  the same ``MemoryRegistry`` (tensors, arrays, buffers), and a peer's published ranges are
  checked with the same ``check_remote`` before NIXL sees a descriptor, so a bad descriptor is a
  ``DescriptorOutOfRange`` / ``MemoryNotRegistered`` naming it, not ``NIXL_ERR_NOT_FOUND``;
* one error channel: NIXL's status strings and exception types become ``transport.errors``
  classes (``PeerDisconnected``, ``TransferTimeout``, ``NixlError``, ...);
* ``await agent.transfer(x, timeout=...)`` runs a transfer to completion under a deadline.

Progress (measured on the 2-core VM with NIXL 1.5.1, UCX over TCP). UCX moves bytes only when
someone progresses its worker, on *both* sides: over TCP a READ is emulated with active
messages that the target must answer, so a target that never progresses never serves (its
peer's READ stays "PROC" for ever). NIXL offers a progress thread, but its Python API creates it
with a poll delay of 0: the thread spins, and an idle agent burns 0.5-0.7 of a core here
(measured with ``time.process_time`` over 3 s). A delay would make it sleep in ``poll()`` on
UCX's event fd, but the Python API does not expose it, and over TCP the first READ after idle
still waited ~2 ms for the thread's 1 ms poll timeout. So the progress thread is off by default
(``progress_thread=True`` turns it on, for the bench to compare) and each agent progresses from
its event loop:

* the initiator of a transfer polls it synchronously for up to ``spin_s`` (a 4-32 KiB READ over
  TCP completes in ~15-40 µs, so small transfers finish without any event-loop hop), then from
  the progress task on every loop iteration until it completes;
* the progress task polls (``get_new_notifs``, which progresses the worker) in bursts of up to
  ``burst_s`` (100 µs) on every loop iteration while the agent is *hot*: a transfer in flight,
  a notification or a completion in the last ``hot_s``, or ``keep_hot()`` (a store calls it when it expects reads: after publishing blocks,
  after serving a check); otherwise every ``idle_poll_s`` (1 ms: the event loop's timer
  granularity), which costs ~2.5 % of a core here. So a READ that reaches a cold target waits up to
  about a millisecond for its first progress; a READ that carries a notification keeps its
  target hot for the next ones;
* every poll of one agent also progresses the other agents of the process (two engines in one
  process, as in the tests, would otherwise wait on each other's progress task).

Pieces. ``check_xfer_state`` (and ``get_new_notifs``) progress UCX's worker until it has nothing
left to do, holding the GIL (a second thread counting saw the whole process stand still): with
one 128 MiB READ over TCP in flight, one call on the initiator took up to 290 ms of CPU, one on
the target 110-125 ms, the event loop stalled all along. So a transfer is cut into NIXL requests
of at most ``PIECE_BYTES`` (2 MiB), at most ``WINDOW`` (2) of them in flight: the longest call
fell to 12.5 ms (initiator) and 7.5-10 ms (target), and 128 MiB took the same time (111 ms, bare
NIXL 110 ms in the same hour; 4 MiB x 4 in flight: 122 ms and 26-46 ms calls). A transfer of one
piece keeps NIXL's own notification; a longer one sends its notification itself after the last
piece completed (NIXL's would leave with the last piece, maybe before another).

Cancellation. NIXL releases an in-flight request by cancelling its UCX requests, and does not
promise that no byte lands afterwards. So a transfer that times out or is cancelled is reported
at once, and its local memory stays *quarantined*: held as in use (``deregister_memory`` raises
``TransferInProgress``, a staging buffer is never handed out again) until the agent closes, when
UCX's worker is destroyed and nothing can land any more (docs/design.md invariant 7). A transfer
that failed because its peer disconnected is settled normally: the connection is gone.

Environment: ``nixl_env`` (importing nixl, the UCX_TLS defaults, NIXL's errors as ours).

Security. UCX carries no authentication: whoever holds an agent's metadata (its worker address
and memory keys) can READ, and WRITE, its registered memory. ``writable=False`` is checked on
the initiator only. Exchange metadata over an authenticated channel (the store uses the HTTP
agent's signed hello) and keep UCX traffic on a trusted network.
"""
from __future__ import annotations

import asyncio
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from tract_async.transport.descs import MemoryRegistry, RegionInfo, Span, XferDescList
from tract_async.transport.errors import (
    AgentClosed,
    HandleReleased,
    NixlError,
    PeerDisconnected,
    TransferCancelled,
    TransferInProgress,
    TransferTimeout,
    TransportError,
    UnknownRemoteAgent,
)
from tract_async.transport.nixl_env import (
    INSTALL_HINT,
    apply_ucx_defaults,
    cuda_present,
    import_nixl,
    mapped_error,
)
from tract_async.transport.xfer import check_pairing, check_remote

__all__ = ["NixlAgent", "NixlXfer"]

SPIN_S = 100e-6        # synchronous poll after posting: covers a small READ over TCP (15-40 µs)
SPIN_VRAM_S = 250e-6   # the same when either side is GPU memory: UCX stages it through
                       # cuda_copy (H200 host, bare NIXL over TCP: 42 µs at 4 KiB, 124 µs at 32 KiB);
                       # past a 100 µs spin a 32 KiB READ took the progress task's hop: 146 µs, 1.31x
PIECE_BYTES = 2 << 20  # one NIXL request at most (see "Pieces" in the module docstring)
WINDOW = 2             # pieces in flight per transfer
HOT_S = 0.02           # poll every loop iteration this long after a notification / keep_hot()
BURST_S = 100e-6       # hot: poll this long per loop iteration (``_burst``)
IDLE_POLL_S = 0.001    # otherwise: the event loop's timer granularity


@dataclass(frozen=True)
class _Peer:
    """A remote agent as this side knows it: its name and the ranges it published to us."""
    name: str
    regions: tuple[RegionInfo, ...]


class NixlXfer:
    """One READ or WRITE between local and remote descriptor lists (NIXL's nixl_xfer_handle).

    ``state``: "INIT" (never posted), "PROC", "DONE", "ERR" (``error`` says why) or "RELEASED".
    A DONE or ERR transfer may be posted again. While posted its local spans count as in use.
    """

    __slots__ = ("agent", "op", "remote_name", "total_bytes", "notif", "spans", "state", "error",
                 "quarantined", "spin_s", "_pieces", "_next", "_live", "_held")

    def __init__(self, agent: NixlAgent, op: str, remote_name: str, total_bytes: int,
                 notif: bytes, spans: list[Span], pieces: list[Any]) -> None:
        self.agent = agent
        self.op = op
        self.remote_name = remote_name
        self.total_bytes = total_bytes
        self.notif = notif
        self.spans = spans
        self.state = "INIT"
        self.error: BaseException | None = None
        self.quarantined = False   # abandoned in flight: its spans stay held until the agent closes
        self.spin_s = agent.spin_s  # ``NixlAgent.transfer``'s synchronous poll for this transfer
        self._pieces = pieces      # NIXL handles, in order (None once released)
        self._next = 0             # the next piece to post
        self._live: list[Any] = []  # pieces in flight
        self._held = False

    def __repr__(self) -> str:
        return f"NixlXfer({self.op} {self.total_bytes} B with {self.remote_name!r}, {self.state})"

    def _hold(self) -> None:
        if not self._held:
            for s in self.spans:
                s.reg.users += 1
            self._held = True

    def _unhold(self) -> None:
        if self._held:
            for s in self.spans:
                s.reg.users -= 1
            self._held = False

    def release(self) -> None:
        """Forget the transfer (NIXL cancels it if in flight: then it is quarantined). Idempotent."""
        self.agent.release_xfer(self)


class NixlAgent:
    """A NIXL agent with the UCX backend, registered memory, peers, transfers and notifications,
    progressed from the event loop (module docstring).

    Lifecycle: construct (creates the NIXL agent), ``register_memory``, ``await start()`` (the
    progress task), exchange metadata, transfer, ``await close()`` (idempotent).
    """

    _local: weakref.WeakSet[NixlAgent] = weakref.WeakSet()   # started agents of this process

    def __init__(self, name: str, *, progress_thread: bool = False, spin_s: float = SPIN_S,
                 hot_s: float = HOT_S, idle_poll_s: float = IDLE_POLL_S,
                 burst_s: float = BURST_S, spin_vram_s: float = SPIN_VRAM_S) -> None:
        """Raises NixlUnavailable (nixl not importable), NixlError (NIXL could not create the
        agent or its UCX backend; the message shows UCX_TLS)."""
        api = import_nixl()
        self.name = name
        self.ucx_env = apply_ucx_defaults()
        self.progress_thread = progress_thread
        self.spin_s, self.hot_s, self.idle_poll_s, self.burst_s = spin_s, hot_s, idle_poll_s, burst_s
        self.spin_vram_s = spin_vram_s
        self._inflight_done = 0       # transfers settled since the last yield (ends a burst)
        try:
            self._nx = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread,
                                                                   backends=["UCX"]))
        except Exception as e:  # noqa: BLE001 - any NIXL/UCX failure: say what was tried
            raise NixlError(f"NIXL could not create agent {name!r} with its UCX backend "
                            f"({type(e).__name__}: {e}); UCX_TLS={os.environ.get('UCX_TLS')!r}"
                            + ("; on a CUDA host UCX_TLS must include cuda_copy"
                               if cuda_present() else "")) from e
        if "UCX" not in self._nx.backends:   # nixl_agent only logs a missing plugin
            raise NixlError(f"NIXL created agent {name!r} without its UCX backend (plugins found: "
                            f"{self._nx.plugin_list}); reinstall nixl ({INSTALL_HINT})")
        self.registry = MemoryRegistry()
        self.stats: dict[str, int] = {"reads": 0, "writes": 0, "bytes_moved": 0, "notifs_sent": 0,
                                      "notifs_received": 0, "spin_done": 0, "quarantined": 0}
        self.closing = False
        self._regs: dict[str, Any] = {}               # registry name -> NIXL registration list
        self._peers: dict[str, _Peer] = {}
        self._xfers: set[NixlXfer] = set()            # created, not released
        self._inflight: dict[NixlXfer, asyncio.Future[None]] = {}
        self._quarantine: list[NixlXfer] = []
        self._notifs: dict[str, list[bytes]] = {}
        self._on_notif: Callable[[str, bytes], None] | None = None
        self._hot_until = 0.0
        self._kick: asyncio.Future[None] | None = None   # wakes the idle progress task early
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the progress task. Raises AgentClosed (started twice, or after close)."""
        if self._task is not None or self.closing:
            raise AgentClosed(f"NIXL agent {self.name!r} was already started")
        self._loop = asyncio.get_running_loop()
        self._kick = self._loop.create_future()
        self._task = asyncio.get_running_loop().create_task(self._progress(),
                                                            name=f"nixl-progress-{self.name}")
        NixlAgent._local.add(self)

    async def close(self) -> None:
        """Abandon transfers in flight, release every transfer, stop progressing, deregister
        memory and destroy the NIXL agent (after which no byte can land: quarantined memory is
        free again). Idempotent."""
        if self.closing:
            return
        self.closing = True
        NixlAgent._local.discard(self)
        for x in list(self._inflight):
            self._abandon(x, TransferCancelled(f"NIXL agent {self.name!r} closed"))
        for x in list(self._xfers):
            self.release_xfer(x)
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        nx, self._nx = self._nx, None
        for reg in self._regs.values():
            try:
                nx.deregister_memory(reg)
            except Exception:  # noqa: BLE001, S110 - the agent is destroyed next anyway
                pass
        self._regs.clear()
        del nx                                          # the UCX worker goes with the agent
        for x in self._quarantine:
            x._unhold()
        self._quarantine.clear()

    async def __aenter__(self) -> NixlAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_open(self) -> Any:
        if self.closing or self._nx is None:
            raise AgentClosed(f"NIXL agent {self.name!r} is closed")
        return self._nx

    # --- memory -------------------------------------------------------------------------------
    def register_memory(self, mem: Any, *, name: str | None = None,
                        writable: bool = True) -> RegionInfo:
        """Register ``mem`` (a contiguous CPU or CUDA tensor, an array, a buffer; see
        ``descs.MemoryRegistry``) with NIXL. Memory registered after ``get_agent_metadata``
        reaches peers only with fresh metadata. ``writable=False`` is advisory (module docstring).

        Raises InvalidDescriptors, MemoryAlreadyRegistered, NixlError, AgentClosed.
        """
        nx = self._check_open()
        info = self.registry.register(mem, name=name, writable=writable)
        try:
            self._regs[info.name] = nx.register_memory(
                [(info.addr, info.nbytes, info.dev_id, "")], info.mem_type)
        except Exception as e:  # noqa: BLE001
            self.registry.deregister(info.name)
            raise mapped_error(e, f"registering {info.nbytes} bytes of {info.mem_type}") from e
        return info

    def deregister_memory(self, name: str) -> None:
        """Raises MemoryNotRegistered, TransferInProgress (a transfer, or a quarantined one,
        still uses it), AgentClosed."""
        nx = self._check_open()
        self.registry.deregister(name)
        reg = self._regs.pop(name)
        try:
            nx.deregister_memory(reg)
        except Exception as e:  # noqa: BLE001
            raise mapped_error(e, f"deregistering {name!r}") from e

    # --- metadata -----------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        """NIXL's metadata of this agent (UCX worker address, memory keys). Raises AgentClosed."""
        return bytes(self._check_open().get_agent_metadata())

    def add_remote_agent(self, metadata: bytes, *, regions: Sequence[RegionInfo] = ()) -> str:
        """Learn a peer from its NIXL metadata; ``regions``: the ranges it published (checked
        before each transfer). Returns its name. Raises MetadataError-like NixlError, AgentClosed."""
        nx = self._check_open()
        try:
            raw = nx.add_remote_agent(bytes(metadata))
        except Exception as e:  # noqa: BLE001
            raise mapped_error(e, "loading a peer's NIXL metadata") from e
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._peers[name] = _Peer(name, tuple(regions))
        return name

    def remove_remote_agent(self, name: str) -> None:
        """Forget a peer (NIXL disconnects from it). Idempotent."""
        if self._peers.pop(name, None) is None or self._nx is None:
            return
        try:
            self._nx.remove_remote_agent(name)
        except Exception:  # noqa: BLE001, S110 - already gone on NIXL's side
            pass

    def has_peer(self, name: str) -> bool:
        return name in self._peers

    # --- transfers ----------------------------------------------------------------------------
    def initialize_xfer(self, operation: str, local: XferDescList, remote: XferDescList,
                        remote_name: str, notif_msg: bytes = b"") -> NixlXfer:
        """A transfer between pairwise equal-length descriptors (not yet posted). READ copies
        remote -> local, WRITE local -> remote; a notification, if given, reaches the peer after
        the transfer completed.

        Raises InvalidOperation, InvalidDescriptors, MemoryNotRegistered (local), UnknownRemoteAgent,
        DescriptorOutOfRange (remote), PeerDisconnected, NixlError, AgentClosed.
        """
        nx = self._check_open()
        check_pairing(operation, local, remote)
        peer = self._peers.get(remote_name)
        if peer is None:
            raise UnknownRemoteAgent(f"no remote NIXL agent {remote_name!r}; add its metadata first")
        if peer.regions:
            check_remote(peer, remote, for_write=operation == "WRITE")
        spans = self.registry.spans(local.rows, local.mem_type, for_write=False, local=True)
        cuts = _cut(local.rows, remote.rows, PIECE_BYTES)
        pieces: list[Any] = []
        try:
            for lrows, rrows in cuts:
                pieces.append(nx.initialize_xfer(
                    operation, nx.get_xfer_descs(lrows, local.mem_type),
                    nx.get_xfer_descs(rrows, remote.mem_type), remote_name,
                    bytes(notif_msg) if len(cuts) == 1 else b""))
        except Exception as e:  # noqa: BLE001
            for h in pieces:
                nx.release_xfer_handle(h)
            raise mapped_error(e, f"{operation} of {len(local)} descriptors with {remote_name!r}") from e
        x = NixlXfer(self, operation, remote_name, local.total_bytes, bytes(notif_msg), spans,
                     pieces)
        if local.mem_type == "VRAM" or remote.mem_type == "VRAM":
            x.spin_s = self.spin_vram_s
        self._xfers.add(x)
        return x

    def release_xfer(self, x: NixlXfer) -> None:
        """Release ``x``'s NIXL handle; one still in flight is abandoned (quarantined). Idempotent."""
        if x.state == "RELEASED":
            return
        if x in self._inflight:
            self._abandon(x, TransferCancelled("the transfer was released in flight"))
        elif x.state == "PROC":      # posted and never waited for: NIXL cancels it
            x.quarantined = True
            self._quarantine.append(x)
            self.stats["quarantined"] += 1
        self._release_handle(x)
        x.state = "RELEASED"
        self._xfers.discard(x)

    def _release_handle(self, x: NixlXfer) -> None:
        pieces, x._pieces, x._live = x._pieces, [], []
        if self._nx is None:
            return
        for h in pieces:
            try:
                self._nx.release_xfer_handle(h)
            except Exception:  # noqa: BLE001, S110 - NIXL refuses to release some failed requests
                pass

    def post(self, x: NixlXfer) -> str:
        """Post ``x`` (NIXL's ``transfer``): "PROC" or "DONE". Poll with ``check_xfer_state`` or
        wait with ``transfer``. Raises HandleReleased, TransferInProgress, PeerDisconnected, ..."""
        nx = self._check_open()
        if x.state == "RELEASED" or not x._pieces:
            raise HandleReleased("this NIXL transfer was released (or abandoned in flight: "
                                 "create a new one)")
        if x.state == "PROC":
            raise TransferInProgress("this NIXL transfer is already in flight")
        x.error = None
        x._hold()
        x.state = "PROC"
        x._next, x._live = 0, []
        while x.state == "PROC" and x._next < len(x._pieces) and len(x._live) < WINDOW:
            self._post_piece(nx, x)
        if x.state == "ERR":
            assert x.error is not None
            raise x.error
        return x.state

    def _post_piece(self, nx: Any, x: NixlXfer) -> None:
        """Post ``x``'s next piece; settles ``x`` when that was its last and it is done at once."""
        h = x._pieces[x._next]
        x._next += 1
        try:
            status = nx.transfer(h, x.notif if len(x._pieces) == 1 else b"")
        except Exception as e:  # noqa: BLE001
            self._settle(x, mapped_error(e, f"posting {x!r}"))
            return
        if status == "ERR":
            self._settle(x, NixlError(f"NIXL refused to post {x!r}"))
        elif status == "PROC":
            x._live.append(h)
        elif x._next == len(x._pieces) and not x._live:
            self._finish(x)

    def check_xfer_state(self, x: NixlXfer) -> str:
        """"INIT", "PROC" or "DONE"; a failed transfer raises its error (as every poll does)."""
        if x.state == "RELEASED":
            raise HandleReleased("this NIXL transfer was released")
        if x.state == "PROC" and x not in self._inflight:
            self._poll_xfer(x)
        if x.state == "ERR":
            assert x.error is not None
            raise x.error
        return x.state

    async def transfer(self, x: NixlXfer, *, timeout: float | None = None) -> None:
        """Post ``x`` and wait until it completes, at most ``timeout`` seconds (None: no limit).

        On timeout or cancellation the transfer is abandoned and quarantined (module docstring).
        Raises TransferTimeout, TransferCancelled, PeerDisconnected, NixlError, HandleReleased,
        TransferInProgress, AgentClosed.
        """
        if self.post(x) == "DONE":
            return
        end = time.perf_counter() + x.spin_s
        if len(x._pieces) == 1 and len(NixlAgent._local) <= 1:
            self._spin_one(x, end)                   # the common small READ: a tight loop
        while x.state == "PROC":                     # small transfers end here, without a hop
            self._poll_xfer(x)
            if x.state != "PROC" or time.perf_counter() > end:
                break
            _progress_local(skip=self)
        if x.state == "PROC":
            fut = asyncio.get_running_loop().create_future()
            self._inflight[x] = fut
            assert self._kick is not None, "NixlAgent.transfer before start()"
            self._wake()
            try:
                # the future itself, not a shield of it: a shield adds a hop, and the progress
                # task's next burst ran before this waiter (+100 µs a transfer, measured)
                async with asyncio.timeout(timeout):
                    await fut
            except TimeoutError:
                self._abandon(x, TransferTimeout(
                    f"{x.op} of {x.total_bytes} bytes with {x.remote_name!r} did not finish within "
                    f"{timeout:g} s; it was cancelled (its local memory stays quarantined)"))
            except asyncio.CancelledError:
                self._abandon(x, TransferCancelled("the transfer's waiter was cancelled"))
                raise
        else:
            self.stats["spin_done"] += 1
        if x.state == "ERR":
            assert x.error is not None
            raise x.error

    def _spin_one(self, x: NixlXfer, end: float) -> None:
        """``transfer``'s synchronous poll of a one-piece transfer with no other agent of this
        process to progress: NIXL's state check in a loop with nothing else in it (bare NIXL's
        own loop), then the usual bookkeeping. Leaves ``x`` PROC when ``end`` passed."""
        if len(x._live) != 1:
            return
        h = x._live[0]
        check, clock = self._nx.check_xfer_state, time.perf_counter
        try:
            state = check(h)
            while state == "PROC" and clock() <= end:
                state = check(h)
        except Exception as e:  # noqa: BLE001
            self._settle(x, mapped_error(e, f"{x!r}"))
            return
        if state == "DONE":
            x._live.clear()
            self._finish(x)
        elif state != "PROC":
            self._settle(x, NixlError(f"{x!r} failed: NIXL status {state}"))

    def _poll_xfer(self, x: NixlXfer) -> None:
        """Check the pieces in flight (it also progresses the worker), post the next ones;
        settles ``x`` when it ended."""
        nx = self._nx
        for h in list(x._live):
            try:
                state = nx.check_xfer_state(h)
            except Exception as e:  # noqa: BLE001
                self._settle(x, mapped_error(e, f"{x!r}"))
                return
            if state == "DONE":
                x._live.remove(h)
            elif state != "PROC":
                self._settle(x, NixlError(f"{x!r} failed: NIXL status {state}"))
                return
        while x._next < len(x._pieces) and len(x._live) < WINDOW and x.state == "PROC":
            self._post_piece(nx, x)
        if x.state == "PROC" and not x._live and x._next == len(x._pieces):
            self._finish(x)

    def _finish(self, x: NixlXfer) -> None:
        """Every piece completed: the notification of a cut transfer, then DONE."""
        if x.notif and len(x._pieces) > 1:
            try:
                self._nx.send_notif(x.remote_name, x.notif)
            except Exception as e:  # noqa: BLE001
                self._settle(x, mapped_error(e, f"notifying {x.remote_name!r} after {x!r}"))
                return
        self._settle(x, None)

    def _settle(self, x: NixlXfer, error: TransportError | None) -> None:
        """``x`` ended. A failure with other pieces still in flight is an abandon (they may
        still land), unless the peer is gone (then nothing more can arrive from it)."""
        if error is not None and x._live and not isinstance(error, PeerDisconnected):
            self._abandon(x, error)
            return
        x._unhold()
        x.state, x.error = ("ERR", error) if error is not None else ("DONE", None)
        if error is None:
            self.stats["reads" if x.op == "READ" else "writes"] += 1
            self.stats["bytes_moved"] += x.total_bytes
        fut = self._inflight.pop(x, None)
        if fut is not None and not fut.done():
            fut.set_result(None)
            self._inflight_done += 1

    def _abandon(self, x: NixlXfer, error: TransportError) -> None:
        """Give up on an in-flight transfer: quarantine its spans, cancel it in NIXL."""
        if x.quarantined:
            return
        fut = self._inflight.pop(x, None)
        if fut is not None and not fut.done():
            fut.set_result(None)     # its waiter sees state ERR and raises ``error``
        x.state, x.error, x.quarantined = "ERR", error, True
        self._quarantine.append(x)
        self.stats["quarantined"] += 1
        self._release_handle(x)

    # --- notifications ------------------------------------------------------------------------
    def send_notif(self, remote_name: str, msg: bytes) -> None:
        """Send a notification (delivered after earlier ones to the same peer; no reply). Raises
        UnknownRemoteAgent, PeerDisconnected, NixlError, AgentClosed."""
        nx = self._check_open()
        if remote_name not in self._peers:
            raise UnknownRemoteAgent(f"no remote NIXL agent {remote_name!r}")
        try:
            nx.send_notif(remote_name, bytes(msg))
        except Exception as e:  # noqa: BLE001
            raise mapped_error(e, f"notifying {remote_name!r}") from e
        self.stats["notifs_sent"] += 1
        self.keep_hot()

    def set_notif_handler(self, handler: Callable[[str, bytes], None] | None) -> None:
        """Call ``handler(sender, msg)`` (on the event loop, from a poll) for each notification
        instead of queueing it for ``get_new_notifs``. It must not block or raise."""
        self._on_notif = handler

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """The queued notifications by sender (as NIXL's get_new_notifs), progressing first."""
        self._poll_once()
        out, self._notifs = self._notifs, {}
        return out

    def keep_hot(self, seconds: float | None = None) -> None:
        """Progress on every loop iteration for the next ``seconds`` (default ``hot_s``): reads
        of this agent's memory are expected (a target must progress to serve them over TCP)."""
        self._hot_until = max(self._hot_until, time.monotonic() + (self.hot_s if seconds is None
                                                                   else seconds))
        self._wake()

    def _wake(self) -> None:
        if self._kick is not None and not self._kick.done():
            self._kick.set_result(None)

    def cool_down(self) -> None:
        """Stop polling hot now (until the next traffic or ``keep_hot``): idle polls only."""
        self._hot_until = 0.0

    # --- progress -----------------------------------------------------------------------------
    def _poll_once(self) -> bool:
        """Progress the worker, deliver notifications, check transfers in flight; True when
        something arrived or completed."""
        nx = self._nx
        if nx is None:
            return False
        active = False
        try:
            notifs = nx.get_new_notifs()
        except Exception:  # noqa: BLE001 - a peer's failure shows in its transfers; keep polling
            notifs = {}
        for sender, msgs in notifs.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            active = True
            self.stats["notifs_received"] += len(msgs)
            for m in msgs:
                if self._on_notif is not None:
                    self._on_notif(name, bytes(m))
                else:
                    self._notifs.setdefault(name, []).append(bytes(m))
        for x in list(self._inflight):
            self._poll_xfer(x)
            active |= x.state != "PROC"
        if active:     # a notification or a completion: more traffic is likely to follow
            self._hot_until = time.monotonic() + self.hot_s
        return active

    def _burst(self) -> None:
        """Hot: poll for up to ``burst_s`` before yielding to the loop, or until a transfer
        completed (its waiter should run now). One poll per loop iteration progressed UCX
        5-10x less often than a bare poll loop, and over TCP the side that sends (the target of
        a READ) moves bytes only when progressed: large READs ran at about half of bare NIXL."""
        end = time.perf_counter() + self.burst_s
        while True:
            self._poll_once()
            if self._inflight:
                _progress_local(skip=self)      # an in-process peer serves this agent's reads
            if self._inflight_done or time.perf_counter() >= end or self.closing:
                self._inflight_done = 0
                return

    async def _progress(self) -> None:
        """The progress task (module docstring): hot while anything is expected, else idle polls."""
        assert self._kick is not None
        loop = asyncio.get_running_loop()
        while not self.closing:
            if self._inflight or time.monotonic() < self._hot_until:
                self._burst()
                await asyncio.sleep(0)
                continue
            self._poll_once()
            # idle: a plain future and a timer (an asyncio.timeout here cost 4-5 % of a core:
            # a cancellation and two exceptions a millisecond)
            if self._kick.done():
                self._kick = loop.create_future()
            timer = loop.call_later(self.idle_poll_s, _resolve, self._kick)
            await self._kick
            timer.cancel()

    def describe(self) -> dict[str, Any]:
        """What a store's stats show about this agent."""
        return {"name": self.name, "progress_thread": self.progress_thread,
                "ucx_tls": self.ucx_env.get("UCX_TLS"), "peers": sorted(self._peers),
                "inflight": len(self._inflight), "quarantined_now": len(self._quarantine),
                **self.stats}


def _cut(local: np.ndarray, remote: np.ndarray, piece_bytes: int
         ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pair rows cut into pieces of at most ``piece_bytes`` (a row longer than that is split),
    as uint64 (n, 3) arrays for NIXL."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    lrows: list[tuple[int, int, int]] = []
    rrows: list[tuple[int, int, int]] = []
    fill = 0
    if int(local[:, 1].sum()) <= piece_bytes:       # the common small case: one piece, as is
        return [(local.astype(np.uint64), remote.astype(np.uint64))]
    for (la, n, ld), (ra, _, rd) in zip(local.tolist(), remote.tolist()):
        off = 0
        while off < n:
            take = min(n - off, piece_bytes - fill)
            lrows.append((la + off, take, ld))
            rrows.append((ra + off, take, rd))
            off += take
            fill += take
            if fill == piece_bytes:
                out.append((np.array(lrows, dtype=np.uint64), np.array(rrows, dtype=np.uint64)))
                lrows, rrows, fill = [], [], 0
    if lrows:
        out.append((np.array(lrows, dtype=np.uint64), np.array(rrows, dtype=np.uint64)))
    return out


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _progress_local(skip: NixlAgent) -> None:
    """Progress every other started agent of this process and event loop once (module
    docstring). Agents of another loop belong to another thread: NIXL's calls are not
    thread-safe in its default sync mode, so they are left alone."""
    for agent in list(NixlAgent._local):
        if agent is not skip and agent._loop is skip._loop:
            agent._poll_once()
