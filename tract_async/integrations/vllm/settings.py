"""The connector's settings, from vLLM's ``kv_connector_extra_config`` (no vLLM import).

Every key is optional except ``region``; unknown keys are refused (a typo must not silently
fall back to a default on one instance of a rack and not on another).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

VLLM_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """What ``--kv-transfer-config '{"kv_connector_extra_config": {...}}'`` may set.

    ``region``: the shared region's path (``tract region init PATH --size ...`` makes it, or
    ``create=True`` here on the first instance). ``node_id``: this vLLM instance's first node
    id in the region; its scheduler takes ``node_id`` and tensor-parallel worker ``r`` takes
    ``node_id + 1 + r``, so instances on one region need ranges that do not overlap.
    ``namespace``: the model's name in the keys (default: the served model); with the KV layout
    it keeps two models' blocks apart. ``seed``: the rack's key seed, equal on every instance.
    ``mode``: "cache" (prefix cache, LRU eviction) or "transfer" (a block is freed once read);
    default "transfer" for ``kv_producer``/``kv_consumer`` and "cache" for ``kv_both``.
    ``load_timeout_s``: how long a worker's load waits for a layer still being written.
    ``remote_wait_s``: a consumer's wait for a ``do_remote_prefill`` request's blocks to appear
    (the scheduler asks again each step; no sleep) before it recomputes them instead.
    ``engine``: further ``EngineConfig`` fields, passed through (e.g. ``liveness_timeout_s``).
    """
    region: str
    node_id: int = 0
    namespace: str | None = None
    seed: str | None = None
    mode: str | None = None
    create: bool = False
    region_bytes: int = 1 << 30
    max_nodes: int = 8
    load_timeout_s: float = 5.0
    remote_wait_s: float = 10.0
    engine: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "ConnectorSettings":
        """Parse ``kv_connector_extra_config``; ValueError names a missing or unknown key."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; "
                             f"the tract connector takes {sorted(known)}")
        if not extra.get("region"):
            raise ValueError('kv_connector_extra_config needs "region": the shared region path '
                             '(e.g. /dev/shm/tract-vllm, made by `tract region init`)')
        s = cls(**dict(extra))
        if s.mode not in (None, "cache", "transfer"):
            raise ValueError(f'kv_connector_extra_config "mode" must be "cache" or "transfer", '
                             f"got {s.mode!r}")
        return s

    def resolved_mode(self, kv_role: str) -> str:
        """The engine mode for this vLLM role (see the class docstring)."""
        if self.mode is not None:
            return self.mode
        return "cache" if kv_role == "kv_both" else "transfer"
