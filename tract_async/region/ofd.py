"""Open-file-description record locks on single bytes of a region file (``F_OFD_SETLK``).

The node-local tiers of tract's protocols use them: the node table keeps two claimants of one
node id apart (``nodes.py``), the global lock lets one process per node contend
(``sync/local.py``), and a creator marks a region that it is still initializing
(``region.py``). Why OFD locks and not ``flock`` or classic POSIX locks: the kernel drops
them when the holder dies, even by SIGKILL, and they conflict between two opens of the file in
one process, so two Engines in one process are kept apart like two processes. They do not reach
across hosts.

Each user locks bytes of its own range, all past the end of any region (offsets at or above
``1 << 40``): nothing in the region's contents is touched.
"""
from __future__ import annotations

import fcntl
import os
import struct

_FLOCK = "hhxxxxqqixxxx"
"""``struct flock`` on x86-64 Linux: type, whence, start, len, pid (with padding)."""


def ofd_lock(fd: int, byte_offset: int, *, exclusive: bool = True, wait: bool = False) -> bool:
    """Take an OFD record lock on one byte; False if another open file description holds it.

    Warning: ``wait=True`` blocks in the kernel without a deadline; callers poll instead."""
    ltype = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    req = struct.pack(_FLOCK, ltype, os.SEEK_SET, byte_offset, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, req)
        return True
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held elsewhere
        return False


def ofd_unlock(fd: int, byte_offset: int) -> None:
    """Release this open file description's lock on one byte (a no-op if it holds none)."""
    req = struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, byte_offset, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, req)



def ofd_held_elsewhere(fd: int, byte_offset: int) -> bool:
    """Whether another open file description holds a write lock on the byte (takes none;
    works on a read-only descriptor)."""
    req = struct.pack(_FLOCK, fcntl.F_RDLCK, os.SEEK_SET, byte_offset, 1, 0)
    ltype = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_OFD_GETLK, req))[0]
    return ltype != fcntl.F_UNLCK
