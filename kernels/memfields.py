"""Positions of the words of a ``Mem`` tuple (``mem.make_mem``), shared by ``mem.py`` and ``sim.py``.

A ``Mem`` is a plain tuple of ten ints, so the kernels read its fields by these constant indices
(Numba folds a module-level int into a static tuple index: no cost over an attribute).

| index | name          | meaning                                                      |
|-------|---------------|--------------------------------------------------------------|
| 0     | base_addr     | address of the mapping's first byte                          |
| 1     | size_bytes    | bytes of the mapping (every access is bounds-checked)        |
| 2     | backend       | BACKEND_HW or BACKEND_SIM                                    |
| 3     | flush_insn    | FLUSH_CLFLUSH or FLUSH_CLFLUSHOPT (hardware backend)         |
| 4     | skip_site     | a flush/invalidate site to omit (fault injection), -1: none  |
| 5     | tags_addr     | sim: int64[cache_lines] (``sim.py`` has the layout)          |
| 6     | lines_addr    | sim: uint64[cache_lines, 8]                                  |
| 7     | dirty_addr    | sim: uint8[cache_lines]                                      |
| 8     | ctl_addr      | sim: uint64[8] (rng, threshold, counters)                    |
| 9     | cache_lines   | sim: number of cache slots (a power of two)                  |
"""
MEM_BASE_ADDR = 0
MEM_SIZE_BYTES = 1
MEM_BACKEND = 2
MEM_FLUSH_INSN = 3
MEM_SKIP_SITE = 4
MEM_TAGS_ADDR = 5
MEM_LINES_ADDR = 6
MEM_DIRTY_ADDR = 7
MEM_CTL_ADDR = 8
MEM_CACHE_LINES = 9
MEM_WORDS = 10
