"""The manager's bell: a requester on the lock manager's host wakes an idle manager at once.

Why. The manager finds requests and releases by polling the region (memory is the only signal
that crosses the hosts of a rack). It polled every 100 µs however long the lock had been
unused: an idle engine that managed the lock took ~18 % of a core and ~8 000 wake-ups a second
on the 2-core VM (``tract_async`` 2026-12-04, ``/proc`` of its scan threads), which the issue's
"≤ 2 % of a core when idle" does not allow, and whose wake-ups land on the cores the event
loops need. Polling rarely instead would make every first grant after a pause wait for the next
look.

So the manager polls at the fast rate only for ``BELL_AFTER_S`` after its last grant or release.
After that its scan (``slots.manager_slice``) sleeps in a ``poll`` of this socket, for at most
``BELL_WAIT_MS``, between looks (not ``SO_RCVTIMEO``: Linux rounds that up to scheduler ticks,
~8 ms on the dev VM; ``poll`` uses a high-resolution timer). A requester on the same host
sends one empty datagram after it posts a request and after it releases (``BellRinger.ring``):
the read returns and the manager looks at once. A requester on another host cannot reach the
socket (its send fails: no such name there) and is seen at the next look, at most
``BELL_WAIT_MS`` later; no ring is needed for correctness, only for latency.

Everyone local. When every node that is not dead runs on the manager's host (the node
table's ``host_id``: one box, every test and benchmark), every request rings, and the idle
scan sleeps on the bell up to the end of its slice (``LOCAL_BELL_WAIT_MS``, capped by the
slice's budget) instead of waking every ``BELL_WAIT_MS`` to look for requests that cannot
ring: ~20 wake-ups a second instead of ~500 (the VM's idle managing engine, 1.5 % of a core,
spent ~1 % of it there). The manager re-reads the node table between slices, so a node of
another host that joins is polled for at ``BELL_WAIT_MS`` from the next slice on (its first
request may wait up to one idle slice, ``ManagerPolicy.idle_slice_s``). A same-host requester
whose ring fails (a full socket buffer means a ring is pending anyway) is seen at the slice's
end.

The socket is a Unix datagram socket in the abstract namespace (nothing is left behind), named by
the region's uuid: one manager per region at a time. A new manager whose predecessor's process
still holds the name (paused, not yet gone) runs without a bell and polls as before; so does a
manager whose bind fails for any other reason.
"""
from __future__ import annotations

import socket
from typing import Any

LOCAL_BELL_WAIT_MS = 1000
"""The bell wait when every live node rings ("Everyone local"); the scan's slice budget caps
each wait (``slots.manager_slice``), so in effect: until a ring or the slice's end."""

BELL_AFTER_S = 0.02
"""How long after its last event the manager still polls every ``sleep_us_max`` (a burst of
requests, a holder about to release) before it sleeps on the bell."""

BELL_WAIT_MS = 2
"""The longest sleep on the bell (a ``poll`` timeout, whole milliseconds): how late a requester
that cannot ring (another host) is seen. ~500 looks a second, each one jitted scan of the lock
lines."""
BELL_WAIT_S = BELL_WAIT_MS / 1000


def bell_name(region: Any) -> bytes:
    """The abstract socket name of ``region``'s manager bell."""
    return b"\0tract-mgr-%s" % region.uuid.hex.encode()


class ManagerBell:
    """The manager's end: a bound, non-blocking socket whose descriptor the jitted scan waits
    on (``poll``, at most ``BELL_WAIT_MS``) and drains (``slots.manager_slice``)."""

    def __init__(self, region: Any) -> None:
        self.name = bell_name(region)
        self._sock: socket.socket | None = None

    def open(self) -> int:
        """Bind the bell; its descriptor, or -1 (name taken, or no Unix sockets): poll."""
        if self._sock is not None:
            return self._sock.fileno()
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                              | socket.SOCK_CLOEXEC)
        except OSError:
            return -1
        try:
            s.bind(self.name)
        except OSError:
            s.close()
            return -1
        self._sock = s
        return s.fileno()

    def close(self) -> None:
        """Unbind (after the last scan that reads it has returned). Idempotent."""
        s, self._sock = self._sock, None
        if s is not None:
            s.close()


class BellRinger:
    """A requester's end: ``ring()`` after posting a request or releasing the lock."""

    def __init__(self, region: Any) -> None:
        self.name = bell_name(region)
        self._tx: socket.socket | None = None
        self.rings = 0
        """Rings sent (delivered or not: a manager on another host hears none)."""

    def ring(self) -> None:
        """Send one empty datagram to the manager's bell; never raises, never blocks."""
        try:
            if self._tx is None:
                self._tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                         | socket.SOCK_CLOEXEC)
            self._tx.sendto(b"", self.name)
            self.rings += 1
        except OSError:
            pass            # no bell on this host, or its buffer is full (it is awake then)

    def close(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.close()
