"""tract_kernels: the Numba primitives through which every shared-region access goes.

Import name ``tract_kernels`` (the source folder is ``kernels/``; the bare name ``kernels`` belongs
to a Hugging Face package that transformers probes). See ``mem.py`` for the access rules and
``sim.py`` for the incoherent backend.
"""
from .mem import (BACKEND_HW, BACKEND_SIM, ENV_BACKEND, LINE_BYTES, Mem, MemState, cpu_flags,
                  mem_state, release_mem,
                  drop_rows_ahead, flush,
                  flush_range, full_fence, invalidate, invalidate_range, load, load_fresh,
                  load_fresh_held, make_mem, nt_copy_raw, prefetch, read_bytes, read_rows, resolve_backend, store, store_fence,
                  store_flush, store_nt, with_skip_site, write_bytes, write_rows, writeback,
                  read_rows_behind)
from .memfields import (MEM_BACKEND, MEM_BASE_ADDR, MEM_CACHE_LINES, MEM_CTL_ADDR,
                        MEM_SIZE_BYTES, MEM_SKIP_SITE)
from .sites import NO_SITE, name_of, registered, site

__all__ = [
    "BACKEND_HW", "BACKEND_SIM", "ENV_BACKEND", "LINE_BYTES", "Mem", "MemState",
    "mem_state", "release_mem", "MEM_BACKEND", "MEM_BASE_ADDR", "MEM_CACHE_LINES",
    "MEM_CTL_ADDR", "MEM_SIZE_BYTES", "MEM_SKIP_SITE", "NO_SITE", "cpu_flags",
    "flush", "flush_range", "full_fence", "invalidate", "invalidate_range", "load", "load_fresh",
    "load_fresh_held",
    "make_mem", "name_of", "nt_copy_raw", "prefetch", "read_bytes", "registered", "resolve_backend", "site",
    "store", "store_fence", "store_flush", "store_nt", "with_skip_site", "write_bytes", "write_rows",
    "read_rows", "read_rows_behind", "drop_rows_ahead", "writeback",
]
