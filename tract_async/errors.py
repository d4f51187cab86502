"""Exceptions: one class per condition, all deriving from :class:`TractError`.

Three tiers (as in vLLM v1): running out of capacity is an expected, typed error the caller
handles (``RegionFull``); misuse raises an error whose message says what to change
(``TensorMismatch``); a broken invariant is an ``AssertionError`` naming the component at fault.
Messages name what was expected and what was found.
"""
from __future__ import annotations


class TractError(Exception):
    """Base class of every error tract_async raises on purpose."""


# --- region: mapping, header, attach --------------------------------------------------------
class RegionError(TractError):
    """Base of region mapping and validation errors."""


class RegionNotFound(RegionError, FileNotFoundError):
    """The region file or device does not exist."""


class RegionExists(RegionError, FileExistsError):
    """create() found a region (or other file) already at the path."""


class RegionPermissionError(RegionError, PermissionError):
    """The region file or device cannot be opened with the needed access."""


class RegionUntrusted(RegionPermissionError):
    """The region file or device could have been written by someone this process does not
    trust (another non-root owner, or writable by every user); SECURITY.md says why."""


class RegionCorrupt(RegionError):
    """The file is not a tract region (bad magic) or its header is inconsistent."""


class RegionTruncated(RegionError):
    """The file is shorter than the size its header records, or than a header."""


class RegionVersionMismatch(RegionError):
    """The region was written by an incompatible format version."""


class RegionLayoutMismatch(RegionError):
    """The region's layout signature differs from this build's (struct sizes or alignment)."""


class RegionInitializing(RegionError, TimeoutError):
    """The region's creator is alive and still initializing it, and attach waited its limit."""


class RegionInUse(RegionError):
    """``remove_on_close``: other nodes were still live on the region, so it was not removed."""


class RegionTooSmall(RegionError):
    """The requested size cannot hold the fixed sections for the requested max_nodes, or a
    region cannot hold one block of the engine's layout; the message names the smallest
    ``region_bytes`` that would."""


class RegionFull(TractError):
    """No space left in the region (after eviction where eviction applies)."""


# --- nodes ------------------------------------------------------------------------------------
class NodeError(TractError):
    """Base of node table errors."""


class NodeIdOutOfRange(NodeError, ValueError):
    """node_id is negative or not below the region's max_nodes."""


class NodeIdInUse(NodeError):
    """Another live process holds this node id (its heartbeat is fresh)."""


class NodeEvicted(NodeError):
    """This node's slot was taken over (it was judged dead, or another process claimed it)."""


# --- root directory -----------------------------------------------------------------------------
class RootDirectoryError(TractError):
    """Base of root-directory errors."""


class RootNameNotFound(RootDirectoryError, KeyError):
    """No root object is published under that name."""


class RootDirectoryFull(RootDirectoryError):
    """Every root-directory slot is in use."""


class RootNameInvalid(RootDirectoryError, ValueError):
    """The name is empty, too long, or not UTF-8."""


# --- configuration ---------------------------------------------------------------------------------
class ConfigError(TractError, ValueError):
    """An EngineConfig / KVLayout field is invalid; the message names the field."""


class MissingExtra(TractError, ImportError):
    """An optional dependency (the ``serve`` extra: the serving stack, ``tract demo``, NVML
    telemetry) is not installed; the message names the extra to install."""


class NixlUnavailable(ConfigError):
    """``transport="nixl"`` was asked for but the nixl package is not importable; the message
    says how to install it (the ``[nixl]`` extra)."""


# --- global lock, lock manager, allocator (added with issue 3) -----------------------------------
class LockError(TractError):
    """Base of global-lock errors."""


class LockTimeout(LockError, TimeoutError):
    """The lock was not granted before the deadline (the request was withdrawn)."""


class LockBusy(LockError):
    """acquire_nowait(): the lock could not be taken without waiting."""


class LockRevoked(LockError):
    """This holder's fencing token was revoked (its heartbeat went stale): it must not write.

    ``orphaned``: chunks (chunk, generation) a claim batch recorded as this node's before the
    revocation was seen; the allocator gives them back at its next hold (never carved)."""

    orphaned: tuple[tuple[int, int], ...] = ()


class LockNotHeld(LockError, RuntimeError):
    """release() or check_token() called by a process that does not hold the lock."""


class AllocError(TractError):
    """Base of allocator errors (RegionFull is raised for out-of-space, see above)."""


class AllocationTooLarge(AllocError, ValueError):
    """The request exceeds the chunk size; configure larger chunks for blocks that big."""


class AllocationInvalid(AllocError, ValueError):
    """free() of an allocation that is not live: double free, foreign region, or stale generation."""


# --- engine -------------------------------------------------------------------------------------
class EngineError(TractError):
    """Base of errors raised by the Engine's public calls."""


class EngineClosed(EngineError):
    """The engine was closed (or never opened); open a new one."""


class BlockNotFound(EngineError, KeyError):
    """A key has no resident block (never stored, or evicted) and no timeout was given."""


class LayerNotReady(EngineError):
    """A layer of a block is still being produced and no timeout was given."""


class TransferTimeout(EngineError, TimeoutError):
    """A wait (for a block, a layer, or the lock) passed its deadline; nothing was changed."""


class BlockEvicted(EngineError):
    """A block was evicted while it was being read: the bytes read are not trusted."""


class TensorMismatch(EngineError, ValueError):
    """A tensor has the wrong shape, dtype or device; the message says what was expected."""


class KeyMismatch(EngineError, ValueError):
    """Keys are malformed (not 32-byte block keys) or do not match the tensor."""


class LayoutMismatch(EngineError):
    """A KV layout differs from the one the region recorded: an engine opened with another
    layout than its namespace's (``Engine.open``), or a get of a block that was stored under a
    namespace of another layout (its bytes would not mean what this engine's layout says).
    The message names both layouts. (Not ``RegionLayoutMismatch``: that one is about the
    region's own struct layout, this build against the region's.)"""


class NamespaceTableFull(RegionFull):
    """Every namespace record of the region is taken (``region/namespaces.py``): a region
    shared by that many (namespace, rank) pairs refuses the next one."""
