"""The counters every KV store of the Engine keeps (region and HTTP), shown by ``Engine.stats()``.

One definition, so that the two stores report the same names for the same things; each store
adds its own counters in a subclass.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TransferStats:
    puts: int = 0
    blocks_stored: int = 0
    blocks_skipped: int = 0
    gets: int = 0
    blocks_read: int = 0
    hits: int = 0
    misses: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    evictions: int = 0
    evictions_for_space: int = 0
    validation_failures: int = 0
    consumed: int = 0
    expired: int = 0
    layer_waits: int = 0
