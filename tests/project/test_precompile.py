"""The warm-up helper's list of kernel signatures (``tract_async/tools/precompile.py``) is
current enough to be worth running: every entry names a jitted kernel and parses to argument
types, and the list covers every kernel module. Nothing here compiles (the list is checked by
names and types only: ``.ci/run`` runs this file before any kernel exists)."""
from __future__ import annotations

import pytest

from tract_async.tools import precompile
from tract_async.tools.warm_signatures import SIGNATURES


def test_every_entry_names_a_kernel_and_parses() -> None:
    assert len(SIGNATURES) >= 50, "regenerate: python -m tract_async.tools.precompile --write"
    ns = precompile._namespace()
    bad = []
    for module, qualname, sig in SIGNATURES:
        try:
            d, args = precompile.resolve(module, qualname, sig, ns)
        except Exception as e:   # noqa: BLE001 - each failure is reported, not the first
            bad.append(f"{module}.{qualname}{sig[:60]}: {type(e).__name__}: {e}")
            continue
        assert len(args) >= 1 and all(hasattr(a, "name") for a in args), (qualname, args)
    assert not bad, "stale entries (python -m tract_async.tools.precompile --write):\n" + \
        "\n".join(bad)


def test_the_list_reaches_the_largest_kernels() -> None:
    """The kernels that take longest to compile (seconds each on the 2-core VM) are listed: the
    helper saves nothing where it does not know them."""
    names = {f"{m}.{q}" for m, q, _ in SIGNATURES}
    for k in ("tract_async.region.index.reserve_batch_counted",
              "tract_async.region.index.evict_lru_batch", "tract_async.sync.slots.manager_slice",
              "tract_async.stores.fused.put_blocks", "tract_async.stores.fused.get_blocks"):
        assert k in names, k


def test_jobs_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(precompile.HELPER_ENV, "1")
    assert precompile.jobs() == 1
    monkeypatch.setenv(precompile.HELPER_ENV, "x")
    with pytest.raises(ValueError, match="TRACT_WARMUP_JOBS"):
        precompile.jobs()
