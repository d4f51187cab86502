"""The summary's "files left in /dev/shm" names only files this pytest session could have made
(issue 36: it blamed this run's tests for another run's files): tests/conftest.py's rule."""
from __future__ import annotations

import os
import subprocess
import sys

from tests import conftest as C


def test_the_pid_a_name_carries():
    assert C._name_pid("tract-test-4242-0123456789ab") == 4242
    assert C._name_pid("tract-test-4242-0123456789ab.cpumarks") == 4242
    assert C._name_pid("tract-test-4242-999999999999") == 4242     # an all-digit suffix is not it
    assert C._name_pid("tract-demo-77-region-cache") == 77
    assert C._name_pid("tract-demo-warm-77") == 77
    assert C._name_pid("tract-warmup-5-deadbeef") == 5
    assert C._name_pid("tract-quickstart") is None
    assert C._name_pid("tract-cpumarks-0a1b2c3d4e5f60718293a4b5c6d7e8f9") is None


def test_only_files_of_this_session_count():
    me = os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "pass"])        # started here, then gone
    child.wait()
    # a dead pid this session never started (os.posix_spawn is not recorded): another run's
    stranger = os.posix_spawn(sys.executable, [sys.executable, "-c", "pass"], dict(os.environ))
    os.waitpid(stranger, 0)
    # a live grandchild, started by a child: its own pid was never recorded here
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen("
                               "[sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "print(p.pid, flush=True); sys.stdin.read(); p.kill()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(parent.stdout.readline())
        assert grandchild not in C._SPAWNED
        assert C._made_here(f"tract-test-{me}-0123456789ab") is True
        assert C._made_here(f"tract-test-{me}-0123456789ab.cpumarks") is True
        assert C._made_here(f"tract-demo-{child.pid}-http") is True
        assert C._made_here(f"tract-warmup-{grandchild}-abcd") is True
        assert C._made_here(f"tract-test-{stranger}-0123456789ab") is False
        assert C._made_here(f"tract-test-{os.getppid()}-0123456789ab") is False  # alive, not ours
        assert C._made_here("tract-quickstart") is None
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
