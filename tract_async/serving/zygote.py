"""A warm parent for CPU services: torch, transformers, the workers and the Numba kernels are
imported once into a *zygote* process, and each service is forked from it instead of starting
a fresh interpreter.

Why: ``python -m tract_async.serving`` spends ~4.5 CPU-seconds importing torch and transformers
and loading the kernels before it does anything (a rack of the 2-core VM: 10.5 CPU-s to start).
A rack starts two or three services, ``tract demo`` one rack, the test suite about twenty. A
fork of the warm zygote costs a few milliseconds and shares its pages copy-on-write.

Who uses it: :func:`tract_async.serving.launcher.spawn_service` with ``launch="fork"`` (the
default for services on the CPU; see :func:`use_fork`). A service on a CUDA device is always
started with exec: a process that forks must not have initialized CUDA, and a fresh interpreter
is the only way to be sure of that, whatever torch or transformers did at import.

What a forked service gets, as an exec'd one does: its own session (``setsid``), its argv, its
whole environment (replaced at the fork), its working directory, stdin, stdout and stderr (file
descriptors passed over the socket), and ``die_with_parent`` (the service asks for SIGTERM when
its parent, the zygote, dies; the zygote asks for SIGKILL when the launcher's thread that
started it ends, so a killed launcher leaves nothing behind). What it cannot get: settings read
at import time from the environment (``NUMBA_*``, ``OMP_NUM_THREADS``) are the zygote's, which
is why a zygote is kept per (environment, working directory) of the launcher and a change of
either starts another one.

Messages: one Unix ``SOCK_SEQPACKET`` pair, a JSON object a packet.

===============  ===========================================  ====================================
direction        body                                         file descriptors
===============  ===========================================  ====================================
launcher -> z    ``{"id", "argv", "env", "cwd"}``             stdin, stdout, stderr of the service
z -> launcher    ``{"id", "pid"}`` once forked                -
z -> launcher    ``{"id", "error"}`` if the zygote refuses    -
z -> launcher    ``{"exit": pid, "code"}`` once reaped        -
===============  ===========================================  ====================================

``code`` follows asyncio's ``returncode``: the exit status, or ``-N`` for signal ``N``.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import itertools
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Any

log = logging.getLogger(__name__)

#: what the zygote imports before it forks anything: every service's heavy imports
PRELOAD = ("torch", "transformers", "tract_async.serving.model", "tract_async.serving.prefill_worker",
           "tract_async.serving.decode_worker", "tract_async.serving.router")
LAUNCH_MODES = ("auto", "fork", "exec")
LAUNCH_ENV = "TRACT_SERVICE_LAUNCH"   # the default of ``launch`` where the caller gives none
_MAX_PACKET = 1 << 20
# the zygote's last argument: room in its command line for each forked service to write its own
# there (_set_cmdline), so that ps and /proc/PID/cmdline show the service, as for an exec'd one
_TITLE_ROOM = "-" * 4096


def use_fork(launch: str | None, device: str | None) -> bool:
    """Whether a service on ``device`` (None: the router, which has none) is forked.

    ``launch``: ``"fork"`` or ``"exec"``, or ``"auto"`` (fork on Linux for a service that is not
    on a CUDA device); None reads :data:`LAUNCH_ENV` (default ``auto``). ``"fork"`` for a CUDA
    service is refused: see the module docstring.

    Raises ValueError: an unknown mode, or fork asked for a CUDA service.
    """
    mode = launch if launch is not None else os.environ.get(LAUNCH_ENV, "auto")
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {mode!r}")
    cuda = bool(device) and not str(device).startswith("cpu")
    if mode == "exec":
        return False
    if cuda:
        if mode == "fork":
            raise ValueError(f"launch='fork' is for CPU services; a service on {device!r} must be "
                             f"exec'd (a forked process must not have initialized CUDA)")
        return False
    return sys.platform.startswith("linux")


# --- the launcher's side ------------------------------------------------------------------------
class ForkedProcess:
    """A service forked by the zygote, with the part of ``asyncio.subprocess.Process`` that the
    launcher uses: ``pid``, ``returncode``, ``stdout``, ``wait``, ``send_signal``, ``terminate``
    and ``kill``. It is not this process's child: its exit status comes from the zygote."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def _exited(self, code: int) -> None:
        """Called from the zygote client's thread."""
        with self._lock:
            self.returncode = code
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):       # that loop has closed meanwhile
                loop.call_soon_threadsafe(_resolve, fut)

    async def wait(self) -> int:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.returncode is None:
                self._waiters.append((loop, fut))
            else:
                fut.set_result(None)
        await fut
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Raises ProcessLookupError once it has exited (as asyncio's Process does)."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class ZygoteError(RuntimeError):
    """The zygote could not start a service (it died, or refused: see the message)."""


class Zygote:
    """The launcher's handle on one zygote process. A thread of its own starts the zygote (so
    that the zygote's parent-death signal follows a thread that lives as long as this process)
    and reads its messages; :meth:`spawn` may be called from any thread or event loop."""

    def __init__(self, env: Mapping[str, str], cwd: str) -> None:
        self.env = dict(env)
        self.cwd = cwd
        self._sock, self._peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Future[ForkedProcess], asyncio.StreamReader | None]] = {}
        self._procs: dict[int, ForkedProcess] = {}
        self._state_lock = threading.Lock()
        self._started: Future[None] = Future()
        self.dead = False
        self.proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="tract-zygote", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tract_async.serving.zygote", str(self._peer.fileno()),
                 str(os.getpid()), _TITLE_ROOM],
                pass_fds=[self._peer.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, env=self.env, cwd=self.cwd, start_new_session=True)
        except BaseException as e:  # noqa: BLE001 -- handed to whoever waits
            self._peer.close()
            self.dead = True
            self._started.set_exception(ZygoteError(f"the zygote did not start: {e!r}"))
            return
        self._peer.close()
        self._started.set_result(None)
        try:
            while True:
                try:
                    data = self._sock.recv(_MAX_PACKET)
                except OSError:
                    data = b""
                if not data:
                    break
                self._dispatch(json.loads(data))
        finally:
            self._gone()

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "exit" in msg:
            with self._state_lock:
                proc = self._procs.pop(msg["exit"], None)
            if proc is not None:
                proc._exited(int(msg["code"]))
            return
        with self._state_lock:
            fut, reader = self._pending.pop(msg["id"], (None, None))
            if fut is None:
                return
            if "error" in msg:
                proc = None
            else:
                # known before the next message is read: its exit message finds it
                proc = self._procs[int(msg["pid"])] = ForkedProcess(int(msg["pid"]), reader)
        try:
            if proc is None:
                fut.set_exception(ZygoteError(msg["error"]))
            else:
                fut.set_result(proc)
        except InvalidStateError:       # the spawn was given up (cancelled, timed out)
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    def _gone(self) -> None:
        """The zygote's socket closed (it died): fail the spawns in flight; the services it had
        forked die with it (their parent-death signal), and are waited for here by pid."""
        self.dead = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._state_lock:
            pending, self._pending = self._pending, {}
            procs, self._procs = self._procs, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(ZygoteError("the zygote died"))
        if self.proc is not None:
            self.proc.wait()
        for proc in procs.values():
            while _alive(proc.pid):
                time.sleep(0.02)
            proc._exited(-signal.SIGTERM)   # its status went to the dead zygote

    async def spawn(self, argv: list[str], *, env: Mapping[str, str], stdin: int, stdout: int,
                    stderr: int, stdout_reader: asyncio.StreamReader | None = None,
                    timeout_s: float = 120.0) -> ForkedProcess:
        """Fork a service running ``python -m tract_async.serving *argv``. The three descriptors
        become its 0, 1 and 2 (the caller closes its own copies afterwards).

        Raises ZygoteError: the zygote died or refused (the caller may exec instead).
        """
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancellation that
        # lands as the awaited future completes (tests/project/test_no_wait_for.py)
        async with asyncio.timeout(timeout_s):
            await asyncio.wrap_future(self._started)
        if self.dead:
            raise ZygoteError("the zygote died")
        rid = next(self._ids)
        fut: Future[ForkedProcess] = Future()
        with self._state_lock:
            self._pending[rid] = (fut, stdout_reader)
        body = json.dumps({"id": rid, "argv": list(argv), "env": dict(env),
                           "cwd": os.getcwd()}).encode()
        try:
            with self._send_lock:
                socket.send_fds(self._sock, [body], [stdin, stdout, stderr])
        except OSError as e:
            with self._state_lock:
                self._pending.pop(rid, None)
            raise ZygoteError(f"the zygote did not take the request: {e!r}") from e
        # given up on (cancelled, timed out), the future is cancelled: a service forked anyway
        # is then killed when its pid arrives (_dispatch)
        async with asyncio.timeout(timeout_s):
            return await asyncio.wrap_future(fut)

    @property
    def idle(self) -> bool:
        """No service of it lives and no spawn is in flight."""
        with self._state_lock:
            return not self._procs and not self._pending

    def close(self, wait_s: float | None = 30.0) -> None:
        """Stop the zygote (the services it forked get SIGTERM: their parent died); wait up to
        ``wait_s`` for its thread (None: do not wait)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if self.proc is not None:       # it may be importing still; it reads the socket after
            with contextlib.suppress(OSError):
                self.proc.kill()
        if wait_s is not None:
            self._thread.join(wait_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):      # a zombie not yet reaped by its new parent
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


_zygotes: dict[tuple[str, frozenset[tuple[str, str]]], Zygote] = {}
_zygotes_lock = threading.Lock()
#: variables left out of a zygote's key: they change all the time and no import reads them
#: (pytest sets the first for each test). A service still gets their current values: the
#: environment is replaced at each fork.
KEY_IGNORES = frozenset({"PYTEST_CURRENT_TEST"})


def zygote_key(env: Mapping[str, str], cwd: str) -> tuple[str, frozenset[tuple[str, str]]]:
    """What must match for a zygote to be reused: the working directory and the environment
    but for :data:`KEY_IGNORES`."""
    return cwd, frozenset((k, v) for k, v in env.items() if k not in KEY_IGNORES)


def zygote() -> Zygote:
    """The zygote for this process's current environment and working directory: started on
    first use and kept until this process exits, or until another environment or directory
    needs a zygote while it has no service alive (each holds torch and transformers in memory,
    ~0.5 GB)."""
    cwd = os.getcwd()
    key = zygote_key(os.environ, cwd)
    with _zygotes_lock:
        z = _zygotes.get(key)
        if z is None or z.dead:
            for other_key, other in list(_zygotes.items()):
                if other_key != key and (other.dead or other.idle):
                    other.close(wait_s=None)
                    del _zygotes[other_key]
            z = _zygotes[key] = Zygote(os.environ, cwd)
        return z


def shutdown_all(wait_s: float = 30.0) -> None:
    """Stop every zygote of this process (their services get SIGTERM) and wait for them: for a
    caller that must see no child left, a test session's end for one. A later spawn starts a
    new zygote."""
    with _zygotes_lock:
        zs = list(_zygotes.values())
        _zygotes.clear()
    for z in zs:
        z.close(wait_s=wait_s)


# --- the zygote's side --------------------------------------------------------------------------
def _preload(modules: tuple[str, ...] = PRELOAD) -> str | None:
    """Import what every service imports; None, or why this zygote must not fork (a failed
    import: the serve extra missing, say; threads started; CUDA initialized). A zygote that
    says why not refuses every spawn with that reason, and the launcher execs instead, where
    the service reports the same failure as its own."""
    import importlib
    try:
        for name in modules:
            importlib.import_module(name)
        from tract_async import kernel_cache
        kernel_cache.preload()
    except Exception as e:  # noqa: BLE001 -- the reason is handed to every spawn request
        return f"the zygote's preload failed: {type(e).__name__}: {e}"
    if threading.active_count() != 1:
        return f"the preload started threads: {threading.enumerate()}"
    import torch
    if torch.cuda.is_initialized():
        return "the preload initialized CUDA"
    return None


def _set_cmdline(args: list[str]) -> None:
    """Write ``args`` over this process's command line (the memory /proc/self/cmdline reads,
    between ``arg_start`` and ``arg_end`` of /proc/self/stat: this process's own stack, where
    the kernel put its argv), truncated to the room there. Best effort: a failure leaves the
    zygote's command line."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])      # fields 48 and 49 of proc(5)
        data = "\0".join(args).encode()[: end - start - 1]
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _child(req: dict[str, Any], fds: list[int], close: list[int]) -> None:
    """In the forked child: become the service, then exit. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [sys.argv[0], *req["argv"]]
        _set_cmdline([sys.executable, "-m", "tract_async.serving", *req["argv"]])
        from tract_async.serving.__main__ import main
        code = main(req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 -- a service's crash, reported as exec'd Python would
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        gc.freeze()      # as serving/__main__ does: no collection of torch's objects at exit
        os._exit(code)


def _serve(sock: socket.socket) -> None:
    why_not = _preload()
    sys.stdout.flush()
    sys.stderr.flush()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)

    def send(msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            sock.send(json.dumps(msg).encode())

    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_PACKET, 3)
                except OSError:
                    data, fds = b"", []
                if not data:
                    return                  # the launcher is gone: so is this zygote
                req = json.loads(data)
                if why_not is not None or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    send({"id": req["id"], "error": why_not or f"{len(fds)} descriptors, not 3"})
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    _child(req, fds, [sock.fileno(), wake_r, wake_w])
                for fd in fds:
                    os.close(fd)
                send({"id": req["id"], "pid": pid})
            else:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 4096):
                        pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def main(argv: list[str]) -> int:
    fd, launcher = int(argv[0]), int(argv[1])
    from tract_async.serving.service import set_pdeathsig
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != launcher:        # the launcher died before prctl took effect
        return 1
    sock = socket.socket(fileno=fd)
    try:
        _serve(sock)
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
