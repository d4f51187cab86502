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


@dataclasses.dataclass
class StoreStats(TransferStats):
    """The region store's counters: the shared ones plus recovery and global-lock figures."""
    reclaimed_entries: int = 0
    stale_entries_dropped: int = 0
    """Evicted entries whose slot had been handed to another reservation (index and allocator
    disagreed): dropped without freeing the slot, which is not theirs."""
    full_without_chunk: int = 0
    """Puts refused at once: no chunk of this node's to make room in, none free to claim."""
    evictions_for_others: int = 0
    """Blocks evicted to release a chunk to a node that asked for one."""
    chunks_given: int = 0
    """Chunks released for nodes that asked (``alloc.py``, "Starving")."""
    lock_acquisitions: int = 0
    lock_wait_s: float = 0.0
    deferred_consume_failures: int = 0
    """Consumed blocks a deferred free (``defer_consume``) could not free: the lock could not
    be had; their transfer deadline frees them."""
    lockfree_reservations: int = 0
    """Reservation batches placed without the global lock (index.py, "Who writes what")."""
    early_copies: int = 0
    """Lock-free reservations whose copies started before their index entries were placed
    (``Reserver._place_after_early``), the placement then whole."""
    early_copies_voided: int = 0
    """The same, where the placement was not whole: the copies waited out, the put copied again."""
    fused_puts: int = 0
    """Puts done in one kernel call (``put_fused``), a subset of ``lockfree_reservations``."""
    fused_gets: int = 0
    """Gets done in one kernel call (``get_fused``)."""
    small_puts: int = 0
    """Fused puts that came by the Engine's one-block fast path (``stores/small.py``)."""
    small_gets: int = 0
    """Fused gets that came by that path."""
    spin_wakes: int = 0
    """Waits that the brief spin on the loop's thread satisfied
    (``readiness.ReadyWaits._spin_on_loop``)."""
    preclaimed_chunks: int = 0
    """Chunks claimed ahead of need by the pre-claim task (module docstring)."""
    evicted_ahead: int = 0
    """This node's blocks evicted ahead of need by the pre-claim task, in a full region
    (``stores/preclaim.py``, "Evicting ahead"); also counted in ``evictions``."""
    unsnapshotted_puts: int = 0
    """Puts (or stages of one) that reserved without an index snapshot (``snapshot_for_put``)."""
    parallel_reads: int = 0
    """Reads done in parallel groups, metadata included (``stores/parallel.py``)."""
    parallel_reads_redone: int = 0
    """Parallel reads that a group sent to the step-by-step path (not ready, changed)."""
    parallel_read_groups: int = 0
    """Groups of parallel reads (the loop's own included)."""
    early_publishes: int = 0
    """Layer publishes stored by the CUDA poller's thread as the DMA landed (``publish_early``),
    before the loop's bookkeeping."""
    known_slot_reads: int = 0
    """Layer reads that took the slots of the previous layer's read of the same keys (layer
    bits re-read at those slots, no lookup: ``prepare_read``)."""
    seen_layer_reads: int = 0
    """Layer reads of a CUDA layer stream that looked at no entry: a validated read of the same
    snapshot had seen the layer in for every block (``cuda/layerstream.py``, "Seen layers")."""
    doorbell_wakes: int = 0
    """Waits that a producer's doorbell woke (the rest found their block on a timer's look,
    or polled: ``stores/doorbell.py``)."""
    doorbell_probe_skips: int = 0
    """Doorbell rings a waiting read answered with one key's lookup instead of a look at every
    key (``readiness.ReadyWaits._on_doorbell``: its probe key was still missing)."""
