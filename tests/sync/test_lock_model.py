"""The lock protocol's model (model/lock.pml) verifies, and every mutation of it fails.

Each run of ``model/check.py``'s CI set is one test: the checks must end with 0 errors and a
complete search, and each mutation (a protocol ingredient removed) must produce an error, so
that a pass means the checker can tell. The figures (states, depth, seconds) are printed.

Finding 1 of the model (``MUT_HOLDER_FIRST``) is also pinned on the real kernel: a manager that
dies between ``slots.write_state``'s stores and its flush must not leave a state line naming the
new holder next to an older token.
"""
from __future__ import annotations

import importlib.util
import mmap
import os
import shutil
import sys
import tempfile
from types import ModuleType

import numpy as np
import pytest

import tract_kernels as K
from tract_async.sync import slots as S

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHECK = os.path.join(_ROOT, "model",
                      "check.py")


def _load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tract_model_check", _CHECK)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


check = _load_check()
_MISSING = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]


@pytest.mark.skipif(bool(_MISSING), reason=f"{' and '.join(_MISSING)} not installed (Debian: "
                    f"apt-get install -y spin gcc; .ci/run installs spin when run as root)")
@pytest.mark.parametrize("run", check.ci_runs(), ids=lambda r: r.name)
def test_model(run, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001 (check.Run)
    work = tempfile.mkdtemp(prefix="tract-spin-")
    try:
        res = check.run_one(run, work, time_limit_s=300)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with capsys.disabled():
        print(f"\n  spin {res.name}: errors {res.errors}, {res.states} states, depth {res.depth}, "
              f"{res.seconds} s{' (' + res.first_error + ')' if res.first_error else ''}")
    detail = f"{res.command}\n{res.notes}"
    if run.expect_error:
        assert res.errors, f"the mutation {run.name} was not detected: {run.what}\n{detail}"
    else:
        assert res.errors == 0, f"{run.name}: {res.errors} errors ({res.first_error})\n{detail}"
        assert res.complete, f"{run.name}: search incomplete {res.notes}\n{detail}"


def _state_after_torn_write(seed: int) -> tuple[int, int, int]:
    """(holder, holder_req, token) in memory after write_state of a grant whose flush never ran.

    One cache slot, so the sim's random early write-back always picks the state line: memory
    ends up with the stores made before some access, a prefix in store order (a manager that
    died before its flush)."""
    page = mmap.mmap(-1, 4096)
    try:
        buf = np.frombuffer(page, dtype=np.uint8)
        old = np.zeros(8, dtype=np.uint64)
        old[S.ST_HOLDER // 8], old[S.ST_HOLDER_REQ // 8], old[S.ST_TOKEN // 8] = 0, 5, 0x1_0000_0003
        buf[:64] = old.view(np.uint8)      # released by node 2: holder none, its req and token
        m = K.make_mem(buf, "sim", seed=seed, evict_prob=0.5, cache_lines=1,
                       skip_site=S.S_M_STATE_FLUSH)
        st = np.zeros(S.M_COLS, dtype=np.int64)
        st[S.M_HOLDER], st[S.M_HOLDER_REQ], st[S.M_TOKEN] = 1, 2, 0x1_0000_0004
        S.write_state(m, 0, st, 1)         # grant to node 1, request 2, the next token
        words = buf[:64].view(np.uint64)
        out = (int(words[S.ST_HOLDER // 8]), int(words[S.ST_HOLDER_REQ // 8]),
               int(words[S.ST_TOKEN // 8]))
        del buf, words, m, old
        return out
    finally:
        page.close()


def test_write_state_torn_line_never_names_holder_with_old_token() -> None:
    seen = {_state_after_torn_write(seed) for seed in range(1, 400)}
    assert len(seen) > 2, f"the early write-backs did not vary: {seen}"   # the test can see prefixes
    for holder, holder_req, token in seen:
        if holder == 2:                    # node 1 named: the line must be the new grant whole
            assert (holder_req, token) == (2, 0x1_0000_0004), (
                f"torn state line names node 1 with holder_req {holder_req} and token "
                f"{token:#x} of an earlier grant (slots.write_state must store holder last)")
