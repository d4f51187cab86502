"""Shared fixtures: unique region paths that are always removed, both memory backends."""
from __future__ import annotations

import glob
import os
import sys
import uuid

import pytest

# One OpenMP thread per torch process (a test run's own, and every process it starts, which
# inherit it; the serving racks' workers set torch_threads=1 themselves). torch's default is a
# thread per core, and an idle OpenMP thread spin-waits: two xdist workers on two cores each
# ran two such threads, and the in-process model tests (test_serving_model.py,
# test_batching.py) took 37-49 s instead of 17-18 s, at 2.5x the CPU time, on the 2-core VM.
# Set before anything imports torch (nothing has yet: pytest and its plugins do not); an
# OMP_NUM_THREADS set outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import tract_async  # noqa: E402,F401 - first: its import keeps ./kernels from shadowing Hugging Face's
from tests.support import xdist_groups  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.hookimpl(trylast=True)   # after pytest-xdist's own (a worker's group suffix)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist_groups.apply(config, items)   # tests/support/xdist_groups.py
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run bench/gpu_suite.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _warm_numba_cache() -> None:
    """Compile every jitted path once before any test spawns workers.

    With a cold cache (a fresh NUMBA_CACHE_DIR) four spawned workers compiling the same kernels
    at once on two cores take long enough to miss their own heartbeats and deadlines. A backend
    whose warm-up already ran into this cache for this build (its stamp, as ``.ci/run``'s
    ``python -m tract_async.tools.warmup`` leaves it) is not run again: CI compiles once. Under
    pytest-xdist every worker is a session: the first to come compiles, under the warm-up's own
    file lock (the one ``Engine.open``'s ``ensure_warm`` takes), and the others then find the
    stamps and load.

    ``TRACT_TESTS_NO_KERNELS=1``: a session that calls no kernel (``.ci/run``'s early pass of
    the tests that need none, while the warm-up compiles) neither warms nor loads; ``.ci/run``
    gives it a cache directory of its own, so that a kernel it did call anyway would compile
    there, not into the cache the warm-up is filling (and fails the run if one did)."""
    if os.environ.get("TRACT_TESTS_NO_KERNELS") == "1":
        return
    import fcntl
    from tract_async.kernel_cache import warm_lock_path
    from tract_async.tools.warmup import stamp_path, warm_up

    def cold() -> tuple[str, ...]:
        return tuple(b for b in ("hw", "sim")
                     if (p := stamp_path(b)) is None or not os.path.exists(p))
    import mmap
    import numpy as np
    import tract_kernels as K
    from tests.support import procs_lock   # its jitted critical section, used by spawned lock workers
    # under the warm-up's file lock, the test kernels too: one xdist worker compiles them (~3 s),
    # the others wait and load, where each of three compiled them at once before
    stamp = stamp_path("hw")
    fd = None
    if stamp is not None:
        try:
            os.makedirs(os.path.dirname(stamp), exist_ok=True)
            fd = os.open(warm_lock_path(stamp), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            fd = None
    try:
        if backends := cold():
            warm_up(backends=backends)
        procs_lock.sleep_us(0)
        page = mmap.mmap(-1, 4096)     # page-aligned scratch memory
        procs_lock.increment(K.make_mem(np.frombuffer(page, dtype=np.uint8), "hw"), 64, 0)
    finally:
        if fd is not None:
            os.close(fd)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Keep each phase's report on the item, so that fixtures can see whether the test passed."""
    rep = yield
    setattr(item, f"_tract_rep_{rep.when}", rep)
    return rep


def _fsck_findings(path: str) -> list[str]:
    """fsck's problems for the region at ``path``; none for a file that is not an attachable
    region (tests of bad files make those on purpose; attach's own tests cover them)."""
    from tract_async.errors import RegionError
    from tract_async.tools.fsck import run_fsck
    try:
        return list(run_fsck(path).problems)
    except RegionError:
        return []


@pytest.fixture
def region_path(request: pytest.FixtureRequest) -> str:
    """A fresh /dev/shm path; the file (and any sibling with its prefix) is removed afterwards.

    Before removal, a test that passed gets an fsck of the region it left: a test that mutates
    a region and leaves a leaked chunk, a lock held by a dead node or an index entry pointing at
    a freed slot fails here even when its own asserts did not look. Tests that leave damage on
    purpose (negative controls) carry ``@pytest.mark.fsck_dirty``."""
    path = f"/dev/shm/tract-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield path
    findings: list[str] = []
    try:
        call = getattr(request.node, "_tract_rep_call", None)
        if (call is not None and call.passed and os.path.exists(path)
                and request.node.get_closest_marker("fsck_dirty") is None):
            findings = _fsck_findings(path)
    finally:
        for p in glob.glob(path + "*"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    if findings:
        pytest.fail("fsck of the region this test left: " + "; ".join(findings)
                    + " (intended damage? mark the test @pytest.mark.fsck_dirty)", pytrace=False)


@pytest.fixture(params=["hw", "sim"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both memory backends: real instructions, and the incoherent-cache model."""
    return request.param


_LEAKS: list[str] = []


def _shm_tract_files() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("tract-")}
    except OSError:
        return set()


_SPAWNED: set[int] = set()
"""The pids of every process this session started (``subprocess.Popen``, which asyncio's
subprocesses use too, and ``multiprocessing``'s ``Process.start``, for every start method),
recorded by ``_record_spawns``, and of every descendant seen alive after a test."""


def _record_spawns() -> None:
    """Record in ``_SPAWNED`` the pid of every process this one starts from now on."""
    import multiprocessing.process
    import subprocess

    popen_init = subprocess.Popen.__init__
    if getattr(popen_init, "_tract_records", False):
        return

    def init(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
        popen_init(self, *args, **kwargs)  # type: ignore[arg-type]
        _SPAWNED.add(self.pid)

    start = multiprocessing.process.BaseProcess.start

    def start_and_record(self: multiprocessing.process.BaseProcess) -> None:
        start(self)
        if self.pid is not None:
            _SPAWNED.add(self.pid)

    init._tract_records = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = start_and_record  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    _record_spawns()


def _name_pid(name: str) -> int | None:
    """The pid a ``tract-*`` file's name carries: its first all-digit ``-`` field after
    ``tract-`` (``tract-test-<pid>-<hex>``, ``tract-demo-<pid>-<mode>``, ``tract-demo-warm-<pid>``,
    ``tract-warmup-<pid>-<hex>``, ``tract-bench-<pid>-...``; a ``.cpumarks`` record is its
    region's), or None (``tract-quickstart``, ``tract-cpumarks-<uuid>``)."""
    for field in name.split(".", 1)[0].split("-")[1:]:
        if field.isdigit() and len(field) <= 10:
            return int(field)
    return None


def _parent_chain_reaches(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``pid`` or an ancestor of live process ``pid`` (from /proc)."""
    for _ in range(64):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[-1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _made_here(name: str) -> bool | None:
    """Whether this pytest session could have made the /dev/shm file ``name``; None when its name
    carries no pid. The rule: the pid in the name is this process's, or one this session
    started (``_SPAWNED``: alive or not, so a worker that made a file and exited counts), or a
    live process whose parent chain reaches this one (a grandchild). Any other pid is another
    run's: a live process outside this tree, or a dead one this session never started (another
    pytest session's test or worker that is gone). A pid reused by another run of a process
    this session started and reaped could still be blamed here: unlikely, not impossible."""
    pid = _name_pid(name)
    if pid is None:
        return None
    return pid == os.getpid() or pid in _SPAWNED or _parent_chain_reaches(pid, os.getpid())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Name the test after which a new ``tract-*`` file is in /dev/shm (CI only counted them, so a
    leak could not be traced): only files this session could have made (``_made_here``), and
    those whose name carries no pid, marked as possibly another run's. Reported in the summary,
    not removed or failed here: another pytest session on the machine makes files too;
    ``.ci/run`` fails on the ``tract-test-*`` files this run left."""
    before = _shm_tract_files()
    try:
        return (yield)
    finally:
        _SPAWNED.update(_child_pids())   # workers still alive now: their files count later too
        new = sorted(_shm_tract_files() - before)
        ours = [f for f in new if _made_here(f)]
        ours += [f"{f} (no pid in the name: maybe another run's)" for f in new if _made_here(f) is None]
        if ours:
            _LEAKS.append(f"{item.nodeid}: {', '.join(ours)}")


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    tr = terminalreporter
    if _STRAYS:
        tr.section("processes still running at the end (killed)")  # type: ignore[attr-defined]
        for line in _STRAYS:
            tr.line(line)  # type: ignore[attr-defined]
    if _LEAKS:
        tr.section("files left in /dev/shm")  # type: ignore[attr-defined]
        for line in _LEAKS:
            tr.line(line)  # type: ignore[attr-defined]


def _child_pids() -> list[int]:
    """This process's live child processes (from /proc: spawned workers, subprocesses), but
    multiprocessing's resource tracker."""
    me, out = str(os.getpid()), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == me and fields[0] != "Z":
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if b"resource_tracker" not in cmd:   # multiprocessing's own, lives to the end
                out.append(int(d))
    return out


_STRAYS: list[str] = []


def _stop_stray_children() -> None:
    """Children still running when the session ends (a test that left a worker behind): they
    could still create or hold a region file after the cleanup below. Give them 5 s, then kill
    them; name them in the summary."""
    import signal
    import time
    deadline = time.monotonic() + 5
    pids = _child_pids()
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = _child_pids()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            cmd = "?"
        _STRAYS.append(f"pid {pid}: {cmd}")
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    zygotes = sys.modules.get("tract_async.serving.zygote")
    if zygotes is not None:     # the warm parents of forked services live to the end: stop them
        zygotes.shutdown_all()
    _stop_stray_children()
    # Only this session's files (the pid is in the name): other pytest sessions may be running.
    leftovers = glob.glob(f"/dev/shm/tract-test-{os.getpid()}-*")
    for p in leftovers:  # a crashed child may have kept one alive; never leave them behind
        try:
            os.unlink(p)
        except OSError:
            pass
