"""`tract demo`: registered on the CLI; a Ctrl-C in the middle leaves no process and no region."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tract_async.cli import build_parser

# issue 37: one xdist worker runs these racks of processes one after another (two at once on
# two cores starved a decode service past its 10 s SIGTERM grace)
pytestmark = pytest.mark.xdist_group("racks")


def test_demo_is_a_cli_subcommand_with_its_options():
    args = build_parser().parse_args(["demo", "--modes", "http,region-cache", "--turns", "2",
                                      "--conversations", "3", "--region-bytes", "64M",
                                      "--out-dir", "x", "--max-new-tokens", "4", "--seed", "1"])
    assert args.turns == 2 and args.conversations == 3 and args.region_bytes == 64 << 20
    assert callable(args.func)


def test_demo_rejects_an_unknown_mode(capsys):
    args = build_parser().parse_args(["demo", "--modes", "carrier-pigeon"])
    assert args.func(args) == 2
    assert "unknown mode" in capsys.readouterr().err


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_sigint_mid_run_stops_every_service_and_removes_the_region(tmp_path):
    """Run the demo until its rack is up, interrupt it, and look for leftovers. The services'
    command lines name the region, which names the demo's pid: none may survive it."""
    proc = subprocess.Popen([sys.executable, "-m", "tract_async.cli", "demo", "--modes",
                             "region-cache", "--conversations", "1", "--turns", "50",
                             "--out-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = f"tract-demo-{proc.pid}-"
    lines = []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:   # wait for the event, not for a time
            lines.append(line)
            if "] up in" in line:
                break
            assert time.monotonic() < deadline, "".join(lines)
        assert _processes_mentioning(marker), "the services should be running now"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(lines) + out
    assert "stopping the services" in out
    assert not _processes_mentioning(marker)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(marker)]


def test_the_demo_gets_only_its_own_options(monkeypatch):
    """The JSON record of a run holds every option: nothing else may ride in the namespace
    (the parser object that main uses for usage errors once made json.dump fail at the end)."""
    import json
    import tract_async.demo as demo
    from tract_async.cli import main
    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda args: seen.append(args) or 0)
    assert main(["demo", "--turns", "2"]) == 0
    record = {k: v for k, v in vars(seen[0]).items() if k != "func"}
    assert record["turns"] == 2 and not [k for k in record if k.startswith("_")]
    json.dumps(record)


@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_exit_status_names_the_signal_that_stopped_the_demo(monkeypatch, sig, status):
    """SIGTERM is not a Ctrl-C: the demo, cancelled and cleaned up by its handler, exits with
    128 + the signal's number, as a shell reports it (the run itself is replaced by one that
    signals itself once its handlers are in place)."""
    import asyncio
    import tract_async.demo as demo
    import tract_async.extras as extras
    monkeypatch.setattr(extras, "check_installed", lambda *a, **k: None)

    async def signalled(args, modes, seen):  # noqa: ANN001, ANN202
        demo._install_cancel_on_signals(seen)
        os.kill(os.getpid(), sig)
        await asyncio.sleep(30)
        return 0
    monkeypatch.setattr(demo, "_main", signalled)
    args = build_parser().parse_args(["demo", "--modes", "http"])
    assert demo.run_demo(args) == status
    assert demo.stopped_status([]) == 130


def _a_dead_pid() -> int:
    """The pid of a process that ran and is gone (reaped), for names of a dead run's files."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_later_demo_removes_the_files_of_dead_runs_only(tmp_path, monkeypatch, capsys):
    """A SIGKILLed demo leaves its regions and their .cpumarks records; the next `tract demo`
    removes those whose pid is gone, says so in one line, and keeps a live run's (this
    process's pid, and a running child's) and every file not named like a demo run's."""
    import tract_async.demo as demo
    import tract_async.extras as extras
    dead = _a_dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = [f"tract-demo-{dead}-region-cache", f"tract-demo-{dead}-region-cache.cpumarks",
                f"tract-demo-warm-{dead}", f"tract-demo-warm-{dead}.cpumarks",
                f"tract-demo-{dead}-http.cpumarks"]   # a record whose region went first
        kept = [f"tract-demo-{os.getpid()}-region-cache", f"tract-demo-{os.getpid()}-region-cache.cpumarks",
                f"tract-demo-warm-{live.pid}", f"tract-demo-{live.pid}-region-transfer",
                f"tract-demo-{dead}-no-such-mode", f"tract-demo-{dead}", f"tract-test-{dead}-x",
                f"my-tract-demo-{dead}-http"]
        for name in gone + kept:
            (tmp_path / name).write_bytes(b"\0" * (1 << 20 if "cpumarks" not in name else 16))
        monkeypatch.setattr(demo, "_region_dir", lambda: str(tmp_path))
        monkeypatch.setattr(extras, "check_installed", lambda *a, **k: None)

        async def run(args, modes, seen):  # noqa: ANN001, ANN202
            return 0
        monkeypatch.setattr(demo, "_main", run)
        assert demo.run_demo(build_parser().parse_args(["demo", "--modes", "http"])) == 0
        assert sorted(os.listdir(tmp_path)) == sorted(kept)
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 and "removed 5 file(s) (2 MiB)" in out[0], out
        assert all(name in out[0] for name in gone)
        assert demo.remove_dead_runs(str(tmp_path)) == []   # nothing more: silent
        assert capsys.readouterr().out == ""
    finally:
        live.kill()
        live.wait()
