"""Configuration records: ``KVLayout`` (the KV geometry) and ``EngineConfig`` (everything else).

Keyword-only, immutable, validated at construction (``__init__`` / ``__post_init__``) so that a
bad field fails there with a message naming the field (``ConfigError``), never later inside the
engine.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import arrays
from .errors import ConfigError, NixlUnavailable


class KVLayout:
    """Geometry of one block of KV cache.

    A block holds ``block_tokens`` tokens of every layer. In the region it is stored layer-major:
    for layer l, K then V, each ``(block_tokens, kv_heads, head_dim)`` contiguous, so one layer of
    a block is one contiguous range (what layer streaming needs).

    ``dtype``: a torch dtype or its name ("bfloat16", the default; ``arrays.DTYPE_NAMES``). The
    layout keeps the name (``dtype_name``); reading ``.dtype`` gives the torch dtype where torch
    is installed (importing it then), else the name. Why not store the torch dtype: the core runs
    without torch on numpy arrays (``tract_async.arrays``), and a process that never touches a
    tensor (a region tool, a spawned worker moving numpy arrays) should not pay torch's ~2 s
    import just to build a layout.

    Immutable and keyword-only, compared and hashed by its five values (a plain class with
    slots rather than a dataclass because ``dtype`` is a derived property).
    """
    __slots__ = ("num_layers", "block_tokens", "kv_heads", "head_dim", "dtype_name", "itemsize",
                 "half_layer_bytes", "layer_bytes", "block_bytes")
    num_layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype_name: str
    itemsize: int
    half_layer_bytes: int
    """Bytes of K (or V) of one layer of one block."""
    layer_bytes: int
    """Bytes of one layer (K and V) of one block."""
    block_bytes: int
    """Bytes of one block, all layers."""

    def __init__(self, *, num_layers: int, block_tokens: int, kv_heads: int, head_dim: int,
                 dtype: Any = "bfloat16") -> None:
        vals = dict(num_layers=num_layers, block_tokens=block_tokens, kv_heads=kv_heads,
                    head_dim=head_dim)
        for name, v in vals.items():
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {v!r}")
        if num_layers > 128:
            raise ConfigError(f"KVLayout.num_layers is at most 128 (per-layer readiness is a "
                              f"128-bit mask), got {num_layers}")
        name = arrays.dtype_name(dtype)
        for k, v in vals.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "dtype_name", name)
        object.__setattr__(self, "itemsize", arrays.ITEMSIZE[name])
        # the sizes, once: the hot paths read them several times per operation (as properties
        # they were four calls of ~0.3 µs each in a one-block GPU layer read's metadata)
        half = block_tokens * kv_heads * head_dim * self.itemsize
        object.__setattr__(self, "half_layer_bytes", half)
        object.__setattr__(self, "layer_bytes", 2 * half)
        object.__setattr__(self, "block_bytes", num_layers * 2 * half)

    @property
    def dtype(self) -> Any:
        """The torch dtype where torch is installed, else the dtype's name."""
        return arrays.layout_dtype(self.dtype_name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"KVLayout is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"KVLayout is immutable: cannot delete {name!r}")

    def _key(self) -> tuple[int, int, int, int, str]:
        return (self.num_layers, self.block_tokens, self.kv_heads, self.head_dim, self.dtype_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVLayout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"KVLayout(num_layers={self.num_layers}, block_tokens={self.block_tokens}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype_name!r})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_layout, self._key())

    def kv_shape(self, num_blocks: int, layer: int | None = None) -> tuple[int, ...]:
        """The tensor shape put_kv / get_kv use for ``num_blocks`` blocks."""
        t = num_blocks * self.block_tokens
        if layer is None:
            return (self.num_layers, 2, t, self.kv_heads, self.head_dim)
        return (2, t, self.kv_heads, self.head_dim)


def _layout(num_layers: int, block_tokens: int, kv_heads: int, head_dim: int,
            dtype: str) -> KVLayout:
    """Unpickle a KVLayout (its ``__reduce__``)."""
    return KVLayout(num_layers=num_layers, block_tokens=block_tokens, kv_heads=kv_heads,
                    head_dim=head_dim, dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything an Engine needs. Defaults suit the demo on one host.

    Region lifetime: a region that ``create=True`` made outlives the engine by default, because
    other nodes may still be attached to it and its prefix cache is worth keeping across a
    restart of one worker; so a second ``create=True`` at the same path raises RegionExists.
    ``overwrite=True`` replaces whatever region is there (its blocks are lost; nodes still
    attached to the old one are not told), and ``remove_on_close=True`` removes the region when
    this engine closes (unless other nodes are still live on it: RegionInUse), which is what a
    script that runs alone wants. Both need ``create=True``.
    """
    layout: KVLayout
    namespace: str = "default"
    region: str | None = None
    region_bytes: int = 1 << 30
    create: bool = False
    overwrite: bool = False                  # create=True: replace a region already at the path
    remove_on_close: bool = False            # create=True: remove the region on close (class doc)
    attach_timeout_s: float = 60.0           # create=False: how long to wait for a live creator
                                             # still initializing the region (Region.attach)
    region_mode: int = 0o600                 # permission bits of a created region file; 0o660 for
                                             # a group (SECURITY.md); never world-writable
    node_id: int = 0
    max_nodes: int = 8
    seed: str = "tract-rack-seed"
    rank: int = 0
    world_size: int = 1
    vllm_compatible_keys: bool = False
    mode: str = "cache"                      # "cache" (prefix cache) or "transfer" (no cache)
    transfer_deadline_s: float = 30.0        # transfer-only blocks nobody consumed are freed then
    defer_consume: bool = False              # transfer mode: a consuming read returns before
                                             # its blocks are freed (a background task takes
                                             # the global lock for them; stores/blocks.py,
                                             # BlockLifecycle.consume)
    mem_backend: str | None = None           # "hw", "sim", or None ($TRACT_MEM_BACKEND, "hw")
    sim_seed: int | None = None
    chunk_bytes: int | None = None           # default: >= 8 blocks a chunk, at least 2 MiB
    index_capacity: int | None = None        # entries; default 2x the blocks that fit
    heartbeat_interval_s: float = 0.1
    """How often this node's GIL-free thread stamps its heartbeat; at most a quarter of
    ``liveness_timeout_s`` (the manager's lease relies on it)."""
    liveness_timeout_s: float = 1.0
    """What "dead" means (docs/operations.md, "What dead means"): a node whose heartbeat is
    older than this *and* whose beat count stood still across max(3, timeout / (4 x interval))
    of the judge's own beats is dead; its lock is revoked, its chunks reclaimed, and a manager
    replaced. The manager's leases are half of it. Raise it on hosts where a live process can be
    kept off the CPU this long (a recovery then takes up to twice as long)."""
    copy_threads: int | None = None          # threads of one large copy (>= 2 MiB, hw; put and
                                             # get), the loop's own thread among them: None =
                                             # from the host (half the cores, 1-8); 1 = one
                                             # thread (stores/cpucopy.py says why)
    preclaim_bytes: int | None = None        # free slots a node keeps claimed ahead of its puts,
                                             # claimed in the background while it is idle, so
                                             # that a put of that size reserves without the
                                             # global lock: None = as much as its largest put so
                                             # far, within its share of the free chunks, and in
                                             # a full cache by evicting its own LRU blocks; 0 =
                                             # off (stores/preclaim.py, "Pre-claimed chunks",
                                             # "Evicting ahead")
    copy_read_ahead: bool = False            # large reads (>= 8 MiB, hw) on the older pair of
                                             # threads (one drops lines ahead, one copies)
                                             # instead of copy_threads row groups
    wait_spin_us: int | None = None          # a same-host wait polls this long on its loop's
                                             # thread (GIL released, other tasks run between
                                             # 20 us slices) before it sleeps on the doorbell:
                                             # None = from the host (stores/waits.py,
                                             # auto_wait_spin_us: 300 below 8 cores, 2000 from
                                             # 8; $TRACT_WAIT_SPIN_US overrides it); 0 = off
    cpu_wake_latency_us: int | None = None   # hold a PM QoS request of this many us on
                                             # /dev/cpu_dma_latency while open (root): idle cores
                                             # stay out of deep C-states, so a sleeping waiter
                                             # wakes faster (cpu_qos.py); None = host policy
    # HTTP transport (region=None, or fallback)
    peers: Sequence[str] = field(default_factory=tuple)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    secret: bytes | None = None
    allow_unauthenticated: bool = False
    fallback: bool = True                    # with a region: HTTP per transfer where it cannot serve
    http_pool_bytes: int | None = None       # HTTP block pool (default: region_bytes)
    # network transport: "http" (the aiohttp agent) or "nixl" (NIXL over UCX for the bytes,
    # the aiohttp agent for the directory; peers without NIXL are read over HTTP). README.
    transport: str = "http"
    nixl_progress_thread: bool = False       # NIXL's own progress thread (it spins: README)
    nixl_pool_device: str = "cpu"            # "cuda[:N]": the block pool in GPU memory (VRAM)
    nixl_staging_bytes: int = 2 << 30        # NIXL READ staging in use at once (more waits)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"EngineConfig.layout must be a KVLayout, got {type(self.layout).__name__}")
        if self.mode not in ("cache", "transfer"):
            raise ConfigError(f"EngineConfig.mode must be 'cache' or 'transfer', got {self.mode!r}")
        if (not isinstance(self.region_mode, int) or isinstance(self.region_mode, bool)
                or not 0 <= self.region_mode <= 0o777 or self.region_mode & 0o002):
            raise ConfigError(f"EngineConfig.region_mode must be permission bits without o+w "
                              f"(0o600, or 0o660 for a group), got {self.region_mode!r}")
        if not isinstance(self.node_id, int) or self.node_id < 0:
            raise ConfigError(f"EngineConfig.node_id must be a non-negative int, got {self.node_id!r}")
        if self.node_id >= self.max_nodes:
            raise ConfigError(f"EngineConfig.node_id {self.node_id} must be below max_nodes "
                              f"{self.max_nodes}")
        if self.region is None and not self.peers and not self.listen_port >= 0:
            raise ConfigError("EngineConfig needs a region path or HTTP peers")
        if self.chunk_bytes is None:
            # a chunk claim takes the global lock and runs recovery: amortize it over >= 8 blocks
            want = max(2 << 20, 8 * self.layout.block_bytes)
            object.__setattr__(self, "chunk_bytes", 1 << math.ceil(math.log2(want)))
        if self.chunk_bytes <= 0 or self.chunk_bytes & (self.chunk_bytes - 1):
            raise ConfigError(f"EngineConfig.chunk_bytes must be a power of two, got {self.chunk_bytes}")
        if self.layout.block_bytes > self.chunk_bytes:
            raise ConfigError(f"a block ({self.layout.block_bytes} bytes) exceeds chunk_bytes "
                              f"({self.chunk_bytes}); raise chunk_bytes to at least "
                              f"{1 << math.ceil(math.log2(self.layout.block_bytes))}")
        if not 0 < self.heartbeat_interval_s <= self.liveness_timeout_s / 4:
            raise ConfigError(
                f"EngineConfig needs 0 < heartbeat_interval_s <= liveness_timeout_s / 4 (the lock "
                f"manager's lease relies on it), got {self.heartbeat_interval_s} and "
                f"{self.liveness_timeout_s}")
        if self.http_pool_bytes is not None and self.http_pool_bytes < self.layout.block_bytes:
            raise ConfigError(f"EngineConfig.http_pool_bytes ({self.http_pool_bytes}) must hold at "
                              f"least one {self.layout.block_bytes}-byte block")
        for name in ("overwrite", "remove_on_close"):
            if getattr(self, name) and not (self.create and self.region is not None):
                raise ConfigError(f"EngineConfig.{name}=True needs create=True and a region path "
                                  f"(only the engine that creates a region replaces or removes it)")
        if not self.attach_timeout_s >= 0:
            raise ConfigError(f"EngineConfig.attach_timeout_s must be >= 0, got "
                              f"{self.attach_timeout_s!r}")
        if self.transport not in ("http", "nixl"):
            raise ConfigError(f"EngineConfig.transport must be 'http' or 'nixl', got {self.transport!r}")
        if self.transport == "nixl" and importlib.util.find_spec("nixl") is None:
            from .transport.nixl_env import INSTALL_HINT
            raise NixlUnavailable(f"EngineConfig.transport='nixl' needs the nixl package, which "
                                  f"is not installed: {INSTALL_HINT}")
        if self.nixl_staging_bytes <= 0:
            raise ConfigError(f"EngineConfig.nixl_staging_bytes must be > 0, got "
                              f"{self.nixl_staging_bytes}")
        if self.nixl_pool_device != "cpu" and not self.nixl_pool_device.startswith("cuda"):
            raise ConfigError(f"EngineConfig.nixl_pool_device must be 'cpu' or 'cuda[:N]', got "
                              f"{self.nixl_pool_device!r}")
        if self.wait_spin_us is not None and (
                not isinstance(self.wait_spin_us, int) or isinstance(self.wait_spin_us, bool)
                or self.wait_spin_us < 0):
            raise ConfigError(f"EngineConfig.wait_spin_us must be None (from the host) or an "
                              f"int >= 0 (0: no spin), got {self.wait_spin_us!r}")
        if self.cpu_wake_latency_us is not None and (
                not isinstance(self.cpu_wake_latency_us, int)
                or isinstance(self.cpu_wake_latency_us, bool) or self.cpu_wake_latency_us < 0):
            raise ConfigError(f"EngineConfig.cpu_wake_latency_us must be None (the host's idle "
                              f"policy) or an int >= 0, got {self.cpu_wake_latency_us!r}")
        if self.preclaim_bytes is not None and (not isinstance(self.preclaim_bytes, int)
                                                or isinstance(self.preclaim_bytes, bool)
                                                or self.preclaim_bytes < 0):
            raise ConfigError(f"EngineConfig.preclaim_bytes must be None (as much as the "
                              f"largest put) or an int >= 0 (0: off), got "
                              f"{self.preclaim_bytes!r}")
        if self.copy_threads is not None and (not isinstance(self.copy_threads, int)
                                              or isinstance(self.copy_threads, bool)
                                              or self.copy_threads < 1):
            raise ConfigError(f"EngineConfig.copy_threads must be None (from the host) or an "
                              f"int >= 1, got {self.copy_threads!r}")
