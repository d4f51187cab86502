"""Map, create, attach and validate a region: a regular or tmpfs file, a hugetlbfs file, or a
devdax character device (``/dev/daxX.Y``, the way CXL Type-3 memory appears on Linux).

The region is the only shared state between nodes. This module owns the mapping and the header;
the node table (``nodes.py``) and root directory (``rootdir.py``) sit on top, and the lock,
allocator and index are sections published in the root directory.

Creation order (publish order for the header): zero the header page, write every header field,
lay out and zero the node table and root directory, publish the sections in the root directory,
flush all of it, and only then store ``init_state = READY`` and flush that line.

A creator that is still at it and one that died midway leave the same bytes (a short file, a
zero header, ``init_state`` not READY), so the bytes cannot tell them apart. The creator's
liveness can: from opening the file until READY it holds an OFD lock on ``CREATE_LOCK_BYTE``
of the file (``ofd.py``), which the kernel drops when it dies. An attacher that finds the
region incomplete while that lock is held waits for READY, up to ``wait_init_s``, and then
raises ``RegionInitializing`` ("still initializing"); one that finds it incomplete and unlocked
reads the header once more (the creator drops the lock only after READY is in memory, so that
read is the verdict) and then reports it as never initialized (``RegionCorrupt``: its creator
died; re-create it). The only moment the two look alike is between the creator's
``open(O_CREAT)`` and its lock, when the file is empty: an empty file younger than
``EMPTY_FILE_GRACE_S`` counts as being created. The lock is seen on this host only: an
attacher on another host sharing a devdax device cannot tell a live creator there from a dead
one and gets ``RegionCorrupt`` at once.

Attach checks, in this order, each failing with its own error and changing nothing: the file
exists and opens (``RegionNotFound``, ``RegionPermissionError``); its owner is root or this uid
and it is not world-writable (``RegionUntrusted``, SECURITY.md); it can hold a header
(``RegionTruncated``); magic (``RegionCorrupt``); format version (``RegionVersionMismatch``);
cache-line size and layout signature (``RegionLayoutMismatch``); header checksum
(``RegionCorrupt``); recorded size against the file (``RegionTruncated``); READY; section bounds.
Any of those but the first two, found while the creator is alive, means "wait".
Magic and format version sit at offsets 0 and 8 in every format version, forever, so that an
old or new region is always named as such rather than as corrupt.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import threading
import time
import uuid as uuid_mod
import zlib
from dataclasses import dataclass
from collections.abc import Collection
from typing import Callable, Sequence

import numpy as np

import tract_kernels as K

from ..errors import (RegionCorrupt, RegionExists, RegionInitializing, RegionLayoutMismatch,
                      RegionNotFound, RegionPermissionError, RegionTooSmall, RegionTruncated,
                      RegionUntrusted,
                      RegionVersionMismatch)
from . import cpumarks
from . import layout as L
from .nodes import NodeTable
from .ofd import ofd_held_elsewhere, ofd_lock, ofd_unlock
from .rootdir import RootDirectory

S_HEADER_READ = K.site("region.header.read.invalidate")
S_HEADER_WRITE = K.site("region.header.write.flush")

DEFAULT_DIR = "/dev/shm"
DAX_ALIGN_BYTES = 2 << 20
_DAX_RE = re.compile(r"^dax\d+\.\d+$")

CREATE_LOCK_BYTE = (1 << 40) + (1 << 23)
"""The OFD lock byte a creator holds until the region is READY (module docstring). Past any
region's end, above the node-id bytes of ``nodes.py`` (``1 << 40`` + id, ids < 4096) and below
the global-lock bytes of ``sync/local.py`` (from ``(1 << 40) + (1 << 24)``)."""

DEFAULT_INIT_WAIT_S = 60.0
"""How long ``attach`` waits for a live creator by default: a 1 GiB region initializes in about
a second, but a creator on a cold Numba cache first compiles the index kernels (tens of
seconds on two cores)."""

EMPTY_FILE_GRACE_S = 2.0
"""An empty, unlocked region file this young may be a creator between its ``open`` and its
lock (module docstring); older, it is a creator that died there (or not a region at all)."""

_RECREATE = ("EngineConfig(create=True, overwrite=True), Region.create(..., overwrite=True) or "
             "`tract region init --force PATH`")
"""How to re-create a region, for the messages that ask for it: the options that exist."""

_INCOMPLETE = (RegionTruncated, RegionCorrupt, RegionVersionMismatch, RegionLayoutMismatch)
"""What validating a region that is still being written can raise (a torn header read too)."""


def default_path(name: str) -> str:
    """The default region path for a name: ``/dev/shm/tract-<name>``."""
    return os.path.join(DEFAULT_DIR, f"tract-{name}")


@dataclass(frozen=True, kw_only=True)
class SectionSpec:
    """A section to lay out at create time. ``nbytes=-1`` takes the rest of the data area."""
    name: str
    nbytes: int
    align_bytes: int = L.PAGE_BYTES
    kind: int = 0


@dataclass(frozen=True, kw_only=True)
class Section:
    """A laid-out section: where it is, in bytes from the region base."""
    name: str
    offset_bytes: int
    nbytes: int
    kind: int


@dataclass(frozen=True, kw_only=True)
class BackingInfo:
    """What kind of memory backs the mapping and how big it can be."""
    kind: str            # "file", "tmpfs", "hugetlbfs", "devdax"
    capacity_bytes: int  # devdax: device size; files: current size
    align_bytes: int     # size granularity


def _mount_fstype(path: str) -> tuple[str, str]:
    """(fstype, super options) of the mount holding ``path`` (longest mount-point prefix)."""
    real = os.path.realpath(path)
    best, best_type, best_opts = "", "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    parts = right.split()
                    best, best_type, best_opts = mnt, parts[0], parts[2] if len(parts) > 2 else ""
    except OSError:
        pass
    return best_type, best_opts


def _hugepage_bytes(opts: str) -> int:
    m = re.search(r"pagesize=(\d+)([KMG]?)", opts)
    if m:
        return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Hugepagesize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 20


def devdax_size(path: str, sysfs_root: str = "/sys") -> tuple[int, int]:
    """(size, alignment) of a devdax device from sysfs. Raises RegionNotFound if unknown."""
    name = os.path.basename(path)
    for sub in ("bus/dax/devices", "class/dax"):
        size_file = os.path.join(sysfs_root, sub, name, "size")
        if os.path.exists(size_file):
            with open(size_file) as f:
                size = int(f.read().strip(), 0)
            align = DAX_ALIGN_BYTES
            align_file = os.path.join(sysfs_root, sub, name, "align")
            if os.path.exists(align_file):
                with open(align_file) as f:
                    align = int(f.read().strip(), 0) or DAX_ALIGN_BYTES
            return size, align
    raise RegionNotFound(f"{path}: devdax device has no size in {sysfs_root}/bus/dax/devices/"
                         f"{name}/size (is the device configured in devdax mode?)")


def backing_info(path: str) -> BackingInfo:
    """Classify the backing of an existing path."""
    st = os.stat(path)
    if stat.S_ISCHR(st.st_mode):
        if not _DAX_RE.match(os.path.basename(path)):
            raise RegionCorrupt(f"{path}: a character device that is not a devdax device "
                                f"(expected /dev/daxX.Y)")
        size, align = devdax_size(path)
        return BackingInfo(kind="devdax", capacity_bytes=size, align_bytes=align)
    fstype, opts = _mount_fstype(path)
    if fstype == "hugetlbfs":
        return BackingInfo(kind="hugetlbfs", capacity_bytes=st.st_size,
                           align_bytes=_hugepage_bytes(opts))
    return BackingInfo(kind="tmpfs" if fstype == "tmpfs" else "file",
                       capacity_bytes=st.st_size, align_bytes=L.PAGE_BYTES)


def _allocate(fd: int, path: str, size_bytes: int) -> None:
    """Back the whole file with pages before mapping it.

    MAP_POPULATE alone read-faults a sparse tmpfs file: every page's first write then takes a
    write fault, so the first put into fresh chunks ran at 9-11 GB/s instead of 20-27 (measured
    on 512 MiB: 15 GB/s first write with MAP_POPULATE, 27 with fallocate + MAP_POPULATE). It also
    turns "/dev/shm is too small" into an error here rather than a SIGBUS on some later store."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise RegionTooSmall(f"{path}: the file system has less than the {size_bytes} bytes "
                                 f"the region needs free (df {os.path.dirname(path) or '.'})"
                                 ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


DEFAULT_MODE = 0o600
"""Permission bits of a created region file: only its owner may map it (SECURITY.md)."""


def check_mode(mode: int) -> None:
    """Raise ValueError unless ``mode`` is permission bits that no other user can write through."""
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
        raise ValueError(f"mode must be permission bits in 0o000..0o777, got {mode!r}")
    if mode & stat.S_IWOTH:
        raise ValueError(f"mode {mode:#o} lets every user write the region (and so rewrite every "
                         f"node's metadata); use 0o600, or 0o660 and a group (SECURITY.md)")


def check_trusted(path: str, fd: int, trusted_uids: Collection[int] = ()) -> None:
    """Refuse a region file or device that someone this process does not trust could write.

    Whoever can write the mapping can rewrite every node's metadata (SECURITY.md), so the file
    must belong to root, to this process's effective uid or to one of ``trusted_uids``, and must
    not be writable by every user. Raises RegionUntrusted, naming what to change.
    """
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid not in (0, me) and st.st_uid not in trusted_uids:
        raise RegionUntrusted(
            f"{path}: owned by uid {st.st_uid}, neither this process's uid {me} nor root: any "
            f"process of uid {st.st_uid} can rewrite the region; run every node as one uid, or "
            f"chown the file to root (root:<group>, mode 0660), or pass trusted_uids="
            f"[{st.st_uid}] if that user is part of the rack")
    if st.st_mode & stat.S_IWOTH:
        raise RegionUntrusted(
            f"{path}: writable by every user (mode {stat.S_IMODE(st.st_mode):04o}): any local "
            f"process can rewrite the region; chmod o-w {path} (regions are created 0600, or "
            f"0660 for a group)")


def _open(path: str, flags: int, mode: int = DEFAULT_MODE) -> int:
    try:
        return os.open(path, flags, mode)
    except FileNotFoundError:
        if flags & os.O_CREAT:
            raise _cannot_create(path) from None
        raise RegionNotFound(f"{path}: no such region file or device") from None
    except NotADirectoryError:
        raise RegionNotFound(f"{path}: a component of the path is not a directory") from None
    except FileExistsError:
        raise RegionExists(f"{path}: already exists (Region.create(..., overwrite=True) "
                           f"replaces it; Region.attach attaches to it)") from None
    except PermissionError as e:
        if flags & os.O_CREAT and not os.path.exists(path):
            raise RegionPermissionError(f"cannot create {path}: no permission to create files "
                                        f"in {os.path.dirname(os.path.abspath(path))} "
                                        f"({e.strerror})") from None
        raise RegionPermissionError(f"{path}: permission denied opening for "
                                    f"{'read/write' if flags & os.O_RDWR else 'read'} ({e.strerror})"
                                    ) from None
    except OSError as e:
        if e.errno == errno.ELOOP and flags & os.O_NOFOLLOW:
            raise RegionUntrusted(f"{path}: is a symbolic link, which create() does not follow "
                                  f"(someone else may have planted it); pass the real path"
                                  ) from None
        if e.errno != errno.EROFS:
            raise
        raise RegionPermissionError(f"cannot write {path}: {os.path.dirname(os.path.abspath(path))}"
                                    f" is on a read-only file system") from None


def _cannot_create(path: str) -> RegionNotFound:
    """Why ``open(O_CREAT)`` found no file to create (ENOENT): the directory is missing, or it
    is on a file system that takes no new files (procfs, sysfs: they answer ENOENT too)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        missing = parent
        while not os.path.isdir(os.path.dirname(missing)):
            missing = os.path.dirname(missing)
        return RegionNotFound(f"cannot create {path}: directory {missing} does not exist "
                              f"(create it first, or choose another path)")
    fstype = _mount_fstype(parent)[0] or "unknown"
    return RegionNotFound(f"cannot create {path}: directory {parent} is on a {fstype} file "
                          f"system, which does not take new files; put the region on tmpfs "
                          f"(/dev/shm), hugetlbfs or a local disk, or use a devdax device")


def check_creatable(path: str) -> None:
    """Raise what creating a region at ``path`` would (``RegionNotFound``, with the same words)
    where its directory does not exist. For a caller that has expensive work to do before it
    creates the region: a serving worker builds its model (seconds of CPU) before it opens its
    engine, and a mistyped ``--region`` should not wait for that to be reported."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise _cannot_create(path)


def _lock_for_create(fd: int, path: str) -> None:
    """Take the creator lock (module docstring) on a freshly opened region file, or refuse:
    another process is creating a region at this path right now."""
    if not ofd_lock(fd, CREATE_LOCK_BYTE):
        os.close(fd)
        raise RegionExists(f"{path}: another process is creating a region there right now")


def being_created(path: str) -> bool:
    """Whether a live process on this host is creating the region at ``path`` (it holds the
    creator lock, or the file is empty and younger than ``EMPTY_FILE_GRACE_S``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if ofd_held_elsewhere(fd, CREATE_LOCK_BYTE):
            return True
        st = os.fstat(fd)
        return (stat.S_ISREG(st.st_mode) and st.st_size == 0
                and time.time() - st.st_mtime < EMPTY_FILE_GRACE_S)
    finally:
        os.close(fd)


DEFAULT_ROOT_SLOTS = 64
"""Root-directory slots of a created region unless asked otherwise: the engine's sections take
a dozen."""


def fixed_bytes(max_nodes: int, root_slots: int) -> int:
    """Bytes taken by the header, node table and root directory (before any section)."""
    node_bytes = L.align_up(max_nodes * L.NODE.itemsize, L.PAGE_BYTES)
    root_bytes = L.align_up(root_slots * L.ROOT_ENTRY.itemsize, L.PAGE_BYTES)
    return L.HEADER_RESERVED_BYTES + node_bytes + root_bytes


def place_sections(sections: Sequence[SectionSpec], size_bytes: int, *, max_nodes: int,
                   root_slots: int) -> list[Section] | None:
    """Where ``create`` lays ``sections`` out in a region of ``size_bytes``: one after another
    from the end of the fixed area, each at its alignment, a section of ``nbytes=-1`` taking
    the rest. None when they do not all fit."""
    offset = fixed_bytes(max_nodes, root_slots)
    if offset > size_bytes or len(sections) > root_slots:
        return None
    placed: list[Section] = []
    for spec in sections:
        offset = L.align_up(offset, spec.align_bytes)
        nbytes = spec.nbytes if spec.nbytes >= 0 else size_bytes - offset
        if nbytes < 0 or offset + nbytes > size_bytes:
            return None
        placed.append(Section(name=spec.name, offset_bytes=offset, nbytes=nbytes, kind=spec.kind))
        offset += nbytes
    return placed


def min_size_bytes(sections: Sequence[SectionSpec], *, max_nodes: int, root_slots: int) -> int:
    """The smallest region (whole pages) that holds the fixed area and ``sections`` as given,
    a section of ``nbytes=-1`` left empty."""
    offset = fixed_bytes(max_nodes, root_slots)
    for spec in sections:
        offset = L.align_up(offset, spec.align_bytes) + max(0, spec.nbytes)
    return L.align_up(offset, L.PAGE_BYTES)


class Region:
    """A mapped region. Use :meth:`create` or :meth:`attach`; close with :meth:`close`.

    ``mem`` is this process's (this node's) view for the kernels; with the sim backend it carries
    this node's private cache, so two Region objects over one file behave like two hosts.
    """

    def __init__(self, *, path: str, fd: int, mm: mmap.mmap, buf: np.ndarray, mem: K.Mem,
                 header: np.void, backing: BackingInfo, readonly: bool) -> None:
        self.path = path
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        self.buf: np.ndarray | None = buf
        """The whole mapping as uint8 (what the Mems point into); None once closed."""
        self._mem: K.Mem | None = mem
        self._made: list[K.Mem] = [mem]   # every Mem over this mapping: released on close
        self._owner_thread = threading.get_ident()
        self._tls = threading.local()
        self._mem_generation = 0
        self._header = header
        self.backing = backing
        self.readonly = readonly
        self.nodes = NodeTable(self, path=path, offset_bytes=int(header["node_table_offset"]),
                               max_nodes=self.max_nodes)
        self.root = RootDirectory(self, path=path, offset_bytes=int(header["rootdir_offset"]),
                                  slots=self.root_slots, region_bytes=self.size_bytes)

    # -- properties ---------------------------------------------------------------------------
    @property
    def mem(self) -> K.Mem | None:
        """This node's view for the kernels.

        With the sim backend every thread gets its own private cache (built on first use):
        the model's cache state is plain arrays, not safe to share between threads, and a
        separate cache per thread is the stricter model (each thread behaves like another
        host, so anything this node publishes to its own other threads must be flushed too).
        The hardware backend keeps no state and is shared.
        """
        m = self._mem
        if (m is None or m[K.MEM_BACKEND] != K.BACKEND_SIM
                or threading.get_ident() == self._owner_thread):
            return m
        got = getattr(self._tls, "mem", None)
        if got is None or got[0] != self._mem_generation:
            seed = (int(K.mem_state(m).ctl[0]) ^ threading.get_ident()) & 0x7FFFFFFF
            tm = self.private_mem(seed)
            got = (self._mem_generation, tm)
            self._tls.mem = got
        return got[1]

    def private_mem(self, seed: int) -> K.Mem:
        """A Mem with its own private cache on the sim backend (the same eviction rate and
        skipped site as ``mem``, the cache seeded with ``seed``), the shared one on hardware.
        Released when the region closes."""
        m = self._mem
        if m is None or m[K.MEM_BACKEND] != K.BACKEND_SIM:
            return m
        ctl = K.mem_state(m).ctl
        tm = K.make_mem(self.buf, "sim", seed=seed,
                        evict_prob=int(ctl[1]) / 2**32, cache_lines=m[K.MEM_CACHE_LINES],
                        skip_site=m[K.MEM_SKIP_SITE])
        self._made.append(tm)
        return tm

    @mem.setter
    def mem(self, value: K.Mem | None) -> None:
        """Replace the owner thread's view (fault injection); other threads rebuild theirs."""
        self._mem = value
        if value is not None:
            self._made.append(value)
        self._mem_generation += 1

    @property
    def size_bytes(self) -> int:
        return int(self._header["region_bytes"])

    @property
    def max_nodes(self) -> int:
        return int(self._header["max_nodes"])

    @property
    def root_slots(self) -> int:
        return int(self._header["root_slots"])

    @property
    def uuid(self) -> uuid_mod.UUID:
        """The generation uuid: different for every create, the same for every attacher."""
        return uuid_mod.UUID(int=(int(self._header["uuid_hi"]) << 64) | int(self._header["uuid_lo"]))

    @property
    def header(self) -> dict[str, int]:
        """A copy of the header fields."""
        return {name: int(self._header[name]) for name in L.HEADER.dtype.names}

    @property
    def data_offset(self) -> int:
        return int(self._header["data_offset"])

    @property
    def data_bytes(self) -> int:
        return int(self._header["data_bytes"])

    def section(self, name: str) -> Section:
        """The section published under ``name``. Raises RootNameNotFound."""
        e = self.root.lookup(name)
        return Section(name=name, offset_bytes=e.offset_bytes, nbytes=e.nbytes, kind=e.kind)

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, size_bytes: int, *, max_nodes: int = 8,
               root_slots: int = DEFAULT_ROOT_SLOTS,
               sections: Sequence[SectionSpec] = (), backend: str | None = None,
               overwrite: bool = False, prefault: bool = True, mode: int = DEFAULT_MODE,
               sim_seed: int = 0, sim_evict_prob: float = 1 / 64,
               initialize: "Callable[[Region], None] | None" = None) -> "Region":
        """Create (format) a region and return it attached.

        ``initialize(region)`` runs after the sections are laid out and before the region is
        marked READY, so that an attacher never sees a section its creator has not formatted.

        ``mode`` is the file's permission bits, set exactly (the umask does not apply): 0o600,
        the default, lets only this uid map the region; 0o660 lets a group share it (then chown
        the file to root:<group>, or run every node as one uid: ``attach`` trusts only files of
        root and of its own uid). A world-writable mode is refused. A devdax device keeps the
        owner and mode its administrator gave it. The last path component is never followed as
        a symlink (a planted link cannot make ``overwrite`` truncate another file).

        Raises RegionExists (a file is there and ``overwrite`` is false), RegionTooSmall (the
        fixed sections and ``sections`` do not fit), RegionPermissionError, RegionNotFound (a
        devdax device without sysfs size), RegionUntrusted (``overwrite`` of a file this process
        does not trust), ValueError for bad arguments.
        """
        check_mode(mode)
        if not 1 <= max_nodes <= 4096:
            raise ValueError(f"max_nodes must be in 1..4096, got {max_nodes}")
        if not 1 <= root_slots <= 65536:
            raise ValueError(f"root_slots must be in 1..65536, got {root_slots}")
        is_dax = path.startswith("/dev/") and _DAX_RE.match(os.path.basename(path)) is not None
        if is_dax:
            dev_size, align = devdax_size(path)
            if size_bytes <= 0:
                size_bytes = dev_size
            if size_bytes > dev_size:
                raise RegionTooSmall(f"{path}: device holds {dev_size} bytes, asked for {size_bytes}")
            size_bytes = size_bytes // align * align
            fd = _open(path, os.O_RDWR)
            _lock_for_create(fd, path)
            if not overwrite and os.pread(fd, 8, 0) == L.MAGIC.to_bytes(8, "little"):
                os.close(fd)
                raise RegionExists(f"{path}: the device already holds a tract region "
                                   f"(Region.create(..., overwrite=True) re-formats it; "
                                   f"Region.attach attaches to it)")
            backing = BackingInfo(kind="devdax", capacity_bytes=dev_size, align_bytes=align)
        else:
            fstype, opts = _mount_fstype(os.path.dirname(os.path.abspath(path)) or ".")
            align = _hugepage_bytes(opts) if fstype == "hugetlbfs" else L.PAGE_BYTES
            size_bytes = L.align_up(size_bytes, align)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (0 if overwrite else os.O_EXCL)
            fd = _open(path, flags, mode)
            _lock_for_create(fd, path)
            try:
                if overwrite:
                    check_trusted(path, fd)
                os.fchmod(fd, mode)   # exactly `mode`, whatever the umask or an old file's mode
            except BaseException as e:
                os.close(fd)
                if isinstance(e, PermissionError) and not isinstance(e, RegionPermissionError):
                    raise RegionPermissionError(f"{path}: cannot set mode {mode:#o}: "
                                                f"{e.strerror}") from None
                raise
            backing = BackingInfo(kind={"hugetlbfs": "hugetlbfs", "tmpfs": "tmpfs"}.get(fstype, "file"),
                                  capacity_bytes=size_bytes, align_bytes=align)
        need = fixed_bytes(max_nodes, root_slots)
        data_offset = need
        got = place_sections(sections, size_bytes, max_nodes=max_nodes, root_slots=root_slots)
        if got is None:
            if not is_dax:
                os.close(fd)
                if not overwrite:
                    os.unlink(path)
            else:
                os.close(fd)
            asked = ", ".join(f"{s.name}={s.nbytes}" for s in sections) or "none"
            if len(sections) > root_slots:
                raise RegionTooSmall(f"{path}: {len(sections)} sections do not fit "
                                     f"{root_slots} root slots; pass root_slots >= "
                                     f"{len(sections)}")
            least = min_size_bytes(sections, max_nodes=max_nodes, root_slots=root_slots)
            raise RegionTooSmall(
                f"{path}: {size_bytes} bytes cannot hold the header, a node table for "
                f"max_nodes={max_nodes}, {root_slots} root slots ({need} bytes together) and the "
                f"sections ({asked}); they need at least {least} bytes: use a size of at least "
                f"that, or fewer nodes")
        placed = got
        try:
            if not is_dax:
                os.ftruncate(fd, 0) if overwrite else None
                os.ftruncate(fd, size_bytes)
                if prefault and backing.kind in ("tmpfs", "file"):
                    _allocate(fd, path, size_bytes)
            mm = cls._map(fd, size_bytes, readonly=False, prefault=prefault)
        except BaseException:
            os.close(fd)
            if not is_dax and not overwrite:
                os.unlink(path)
            raise
        buf = np.frombuffer(mm, dtype=np.uint8)
        mem = K.make_mem(buf, backend, seed=sim_seed, evict_prob=sim_evict_prob)
        gen = uuid_mod.uuid4().int
        hdr = np.zeros(1, dtype=L.HEADER.dtype)[0]
        node_bytes = L.align_up(max_nodes * L.NODE.itemsize, L.PAGE_BYTES)
        hdr["magic"] = L.MAGIC
        hdr["format_version"] = L.FORMAT_VERSION
        hdr["line_bytes"] = L.LINE_BYTES
        hdr["layout_signature"] = L.layout_signature()
        hdr["region_bytes"] = size_bytes
        hdr["uuid_hi"] = gen >> 64
        hdr["uuid_lo"] = gen & (2**64 - 1)
        hdr["max_nodes"] = max_nodes
        hdr["root_slots"] = root_slots
        hdr["created_ns"] = time.time_ns()
        hdr["node_table_offset"] = L.HEADER_RESERVED_BYTES
        hdr["node_table_bytes"] = node_bytes
        hdr["rootdir_offset"] = L.HEADER_RESERVED_BYTES + node_bytes
        hdr["rootdir_bytes"] = need - L.HEADER_RESERVED_BYTES - node_bytes
        hdr["data_offset"] = data_offset
        hdr["data_bytes"] = size_bytes - data_offset
        hdr["init_state"] = 0
        raw = bytearray(hdr.tobytes())
        hdr["header_checksum"] = zlib.crc32(bytes(raw[:L.HEADER_CHECKSUM_SPAN]))
        # 1. zero the fixed area (header page, node table, root directory) straight to memory
        zeros = np.zeros(need, dtype=np.uint8)
        K.write_bytes(mem, 0, zeros.ctypes.data, need, S_HEADER_WRITE)
        # 2. header fields, init_state still 0
        hbytes = np.frombuffer(hdr.tobytes(), dtype=np.uint8).copy()
        K.write_bytes(mem, 0, hbytes.ctypes.data, hbytes.size, S_HEADER_WRITE)
        region = cls(path=path, fd=fd, mm=mm, buf=buf, mem=mem, header=hdr, backing=backing,
                     readonly=False)
        # 3. sections into the root directory (the creator is the only party alive)
        for sec in placed:
            region.root.publish_unlocked(sec.name, sec.offset_bytes, sec.nbytes, sec.kind)
        if is_dax:  # a device is not zeroed by ftruncate: clear every section but the last
            for sec in placed[:-1]:
                z = np.zeros(sec.nbytes, dtype=np.uint8)
                K.write_bytes(mem, sec.offset_bytes, z.ctypes.data, sec.nbytes, S_HEADER_WRITE)
        if initialize is not None:
            try:
                initialize(region)
            except BaseException:
                region.close()
                if not is_dax:
                    os.unlink(path)
                raise
        K.flush_range(mem, 0, need, S_HEADER_WRITE)
        # 4. READY last: an attacher never sees READY before everything above is in memory;
        # then the creator lock goes (an attacher that saw it held now finds READY)
        K.store_flush(mem, L.INIT_STATE_OFFSET, L.INIT_READY, S_HEADER_WRITE)
        hdr["init_state"] = L.INIT_READY
        ofd_unlock(fd, CREATE_LOCK_BYTE)
        return region

    @classmethod
    def attach(cls, path: str, *, backend: str | None = None, readonly: bool = False,
               prefault: bool = True, sim_seed: int = 0, sim_evict_prob: float = 1 / 64,
               wait_init_s: float = DEFAULT_INIT_WAIT_S,
               trusted_uids: Collection[int] = ()) -> "Region":
        """Attach to an existing region after validating its header (see the module docstring).

        The file must belong to root, to this process's uid or to one of ``trusted_uids``, and
        must not be writable by every user (``check_trusted``; SECURITY.md). A region that a
        live process on this host is still creating is waited for, up to ``wait_init_s``
        seconds (0: not at all); this blocks the calling thread (``Engine`` waits without
        blocking its event loop).

        Raises RegionNotFound, RegionPermissionError, RegionUntrusted, RegionTruncated,
        RegionCorrupt, RegionVersionMismatch, RegionLayoutMismatch, RegionInitializing (the
        creator is alive and had not finished after ``wait_init_s``). Nothing in the region is
        written.
        """
        deadline = time.monotonic() + max(0.0, wait_init_s)
        pause_s = 0.002
        while True:
            try:
                return cls._attach_once(path, backend=backend, readonly=readonly,
                                        prefault=prefault, sim_seed=sim_seed,
                                        sim_evict_prob=sim_evict_prob, trusted_uids=trusted_uids)
            except _INCOMPLETE:
                if not being_created(path):
                    # the creator may have finished between that read and this check: it drops
                    # the lock only after READY is in memory, so one more read is the verdict
                    return cls._attach_once(path, backend=backend, readonly=readonly,
                                            prefault=prefault, sim_seed=sim_seed,
                                            sim_evict_prob=sim_evict_prob,
                                            trusted_uids=trusted_uids)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegionInitializing(
                        f"{path}: still initializing: its creator (a live process on this host) "
                        f"had not finished after {wait_init_s:g} s of waiting") from None
            time.sleep(min(pause_s, left))
            pause_s = min(2 * pause_s, 0.05)

    @classmethod
    def _attach_once(cls, path: str, *, backend: str | None, readonly: bool, prefault: bool,
                     sim_seed: int, sim_evict_prob: float,
                     trusted_uids: Collection[int] = ()) -> "Region":
        if not os.path.exists(path):
            raise RegionNotFound(f"{path}: no such region file or device")
        fd = _open(path, os.O_RDONLY if readonly else os.O_RDWR)
        try:
            check_trusted(path, fd, trusted_uids)
            backing = backing_info(path)
            size = backing.capacity_bytes
            if size < L.HEADER.itemsize:
                raise RegionTruncated(f"{path}: {size} bytes, smaller than the "
                                      f"{L.HEADER.itemsize}-byte region header")
            # pre-fault like create does: a first touch of a page costs a fault on the data path
            # (a re-attached region's put ran at a third of a created one's speed)
            mm = cls._map(fd, size, readonly=readonly, prefault=prefault and not readonly)
        except BaseException:
            os.close(fd)
            raise
        try:
            buf = np.frombuffer(mm, dtype=np.uint8)
            mem = K.make_mem(buf, backend, seed=sim_seed, evict_prob=sim_evict_prob)
            raw = np.zeros(L.HEADER.itemsize, dtype=np.uint8)
            K.read_bytes(mem, 0, raw.ctypes.data, raw.size, S_HEADER_READ)
            hdr = raw.view(L.HEADER.dtype)[0].copy()
            cls._validate(path, hdr, raw, size)
        except BaseException:
            buf = mem = None  # drop the views so that the mapping can close
            mm.close()
            os.close(fd)
            raise
        return cls(path=path, fd=fd, mm=mm, buf=buf, mem=mem, header=hdr, backing=backing,
                   readonly=readonly)

    @staticmethod
    def _validate(path: str, hdr: np.void, raw: np.ndarray, size: int) -> None:
        if int(hdr["magic"]) != L.MAGIC:
            raise RegionCorrupt(f"{path}: not a tract region: magic {int(hdr['magic']):#018x}, "
                                f"expected {L.MAGIC:#018x}")
        if int(hdr["format_version"]) != L.FORMAT_VERSION:
            raise RegionVersionMismatch(
                f"{path}: region format version {int(hdr['format_version'])}, this build reads "
                f"version {L.FORMAT_VERSION}; re-create the region with this build ({_RECREATE})")
        if int(hdr["line_bytes"]) != L.LINE_BYTES:
            raise RegionLayoutMismatch(f"{path}: region uses {int(hdr['line_bytes'])}-byte lines, "
                                       f"this build {L.LINE_BYTES}")
        sig = L.layout_signature()
        if int(hdr["layout_signature"]) != sig:
            raise RegionLayoutMismatch(
                f"{path}: layout signature {int(hdr['layout_signature']):#018x} differs from this "
                f"build's {sig:#018x} (struct sizes or alignment changed); re-create the region "
                f"({_RECREATE})")
        crc = zlib.crc32(raw[:L.HEADER_CHECKSUM_SPAN].tobytes())
        if int(hdr["header_checksum"]) != crc:
            raise RegionCorrupt(f"{path}: header checksum {int(hdr['header_checksum']):#x}, "
                                f"computed {crc:#x}: the header is damaged")
        want = int(hdr["region_bytes"])
        if want > size:
            raise RegionTruncated(f"{path}: header records {want} bytes, the file holds {size}")
        if int(hdr["init_state"]) != L.INIT_READY:
            raise RegionCorrupt(f"{path}: region was never fully initialized (init_state "
                                f"{int(hdr['init_state']):#x}) and no process on this host is "
                                f"creating it: its creator died midway: re-create it "
                                f"({_RECREATE})")
        mn, rs = int(hdr["max_nodes"]), int(hdr["root_slots"])
        spans = [
            ("node table", int(hdr["node_table_offset"]), int(hdr["node_table_bytes"]),
             mn * L.NODE.itemsize),
            ("root directory", int(hdr["rootdir_offset"]), int(hdr["rootdir_bytes"]),
             rs * L.ROOT_ENTRY.itemsize),
            ("data area", int(hdr["data_offset"]), int(hdr["data_bytes"]), 0),
        ]
        prev_end = L.HEADER_RESERVED_BYTES
        for name, off, nb, need in spans:
            if off < prev_end or off + nb > want or nb < need or off % L.LINE_BYTES:
                raise RegionCorrupt(f"{path}: {name} at [{off}, {off + nb}) is out of bounds or "
                                    f"overlaps (region {want} bytes, needs {need} bytes)")
            prev_end = off + nb

    @staticmethod
    def _map(fd: int, size: int, *, readonly: bool, prefault: bool) -> mmap.mmap:
        flags = mmap.MAP_SHARED
        if prefault and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        prot = mmap.PROT_READ | (0 if readonly else mmap.PROT_WRITE)
        try:
            return mmap.mmap(fd, size, flags=flags, prot=prot)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                raise RegionPermissionError(f"cannot map the region: {e.strerror}") from None
            raise

    def close(self) -> None:
        """Unmap and close. Idempotent. Views handed out earlier must have been dropped."""
        if self._mm is None:
            return
        self.nodes.close_mapping()
        self.mem = None
        for m in self._made:
            K.release_mem(m)
        self._made.clear()
        self.buf = None
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            # A caller still holds a view (a tensor over the region). The mapping then stays
            # until that view is garbage-collected; the file descriptor is closed regardless.
            pass
        finally:
            os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _uuid_hex_of(path: str) -> str | None:
    """The generation uuid in the header of the region at ``path`` (hex), or None when it has
    no readable region header."""
    try:
        with open(path, "rb") as f:
            raw = f.read(L.HEADER.itemsize)
    except OSError:
        return None
    if len(raw) < L.HEADER.itemsize:
        return None
    hdr = np.frombuffer(raw, dtype=L.HEADER.dtype)[0]
    if int(hdr["magic"]) != L.MAGIC:
        return None
    return uuid_mod.UUID(int=(int(hdr["uuid_hi"]) << 64) | int(hdr["uuid_lo"])).hex


def discard(path: str) -> None:
    """Delete a scratch region file this process made (the warm-up's, the demo's, a launched
    rack's) and this host's record of its cached payload (``cpumarks``), whichever exist."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    cpumarks.remove(path, None)


def remove(path: str) -> None:
    """Delete a file-backed region (a devdax device is wiped of its header instead).

    Raises RegionNotFound, RegionPermissionError.
    """
    if not os.path.exists(path):
        raise RegionNotFound(f"{path}: no such region file or device")
    cpumarks.remove(path, _uuid_hex_of(path))      # this host's record of cached payload
    if stat.S_ISCHR(os.stat(path).st_mode):
        fd = _open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"\0" * L.HEADER.itemsize, 0)
        finally:
            os.close(fd)
        return
    try:
        os.unlink(path)
    except PermissionError as e:
        raise RegionPermissionError(f"{path}: cannot remove: {e.strerror}") from None
