"""The KV stores the Engine dispatches to, and what they share.

* ``blocks``: ``BlockLifecycle``, the one owner of a region block's lifecycle (reserve, fill,
  publish, validate a read, touch, abandon);
* ``region``: ``RegionStore``, the CPU copy and CUDA DMA back-ends beneath it;
* ``http``: ``HttpStore``, the network transport (the NIXL-style aiohttp agent), with its block
  ``pool`` and its ``directory`` of who holds what;
* ``fallback``: ``FallbackStore``, region first and the network per transfer where the region
  cannot serve;
* ``protocol``: ``Store``, the typed interface all of them implement;
* ``plan`` (tensor <-> block row plans and argument checks), ``waits`` (event-driven polls of
  region words), ``stats`` (the counters every store keeps).

Import the submodules directly (``from tract_async.stores.region import RegionStore``): this
package imports nothing itself, so ``import tract_async`` stays light.
"""
