"""Exceptions: one class per condition, all deriving from :class:`TractError`.

Three tiers (as in vLLM v1): running out of capacity is an expected, typed error the caller
handles (``RegionFull``); misuse raises an error whose message says what to change
(``ShapeMismatch``); a broken invariant is an ``AssertionError`` naming the component at fault.
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


class RegionCorrupt(RegionError):
    """The file is not a tract region (bad magic) or its header is inconsistent."""


class RegionTruncated(RegionError):
    """The file is shorter than the size its header records, or than a header."""


class RegionVersionMismatch(RegionError):
    """The region was written by an incompatible format version."""


class RegionLayoutMismatch(RegionError):
    """The region's layout signature differs from this build's (struct sizes or alignment)."""


class RegionTooSmall(RegionError):
    """The requested size cannot hold the fixed sections for the requested max_nodes."""


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
