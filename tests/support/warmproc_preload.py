"""Imported once by the forkserver of :mod:`tests.support.warmproc`: the package and every
Numba kernel its engine uses, loaded from the cache, so forked children start warm."""
from __future__ import annotations

import tract_async  # noqa: F401
from tract_async import kernel_cache
import tests.support.procs_engine  # noqa: F401  (the children's targets)
import tests.support.procs_lock  # noqa: F401
import tests.support.procs_rack  # noqa: F401
import tract_async.tools.soak  # noqa: F401  (the soak's workers)

LOADED = kernel_cache.preload()
