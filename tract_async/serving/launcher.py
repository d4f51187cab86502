"""Process management: start a rack (prefill, decode, router) as separate processes, stop it.

Each service runs ``python -m tract_async.serving ROLE ...`` (exec'd, or on the CPU forked
from the warm zygote of :mod:`tract_async.serving.zygote`, which imported it all once) in a
session of its own (a Ctrl-C at the terminal reaches the launcher only, which then stops the
services in order), with
``--die-with-parent`` (the kernel stops them if the launcher dies without cleaning up), stdout a
pipe for the one ``TRACT-READY {json}`` line, stderr a log file. Ports are 0: each service binds
a free port on 127.0.0.1 and reports it in its ready line.

Order. Start: the prefill worker creates the region (node 0) while the decode worker starts
(node 1; its engine waits for the region to appear); the router starts once both listen.
Stop: router, decode, prefill, each SIGTERM then, after a deadline, SIGKILL; then the region file
is removed. ``Rack.stop`` is idempotent and runs on every exit path of ``async with Rack(...)``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import IO, Any

from tract_async.serving.errors import ServiceStartFailed
from tract_async.serving.protocol import NET_MODES, READY_PREFIX, REGION_MODES, SECRET_ENV
from tract_async.serving.service import ServiceConfig, config_to_argv
from tract_async.serving.zygote import ForkedProcess, ZygoteError, use_fork, zygote

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServiceProcess:
    """One started service: its process, what its ready line said, where it logs."""
    role: str
    proc: asyncio.subprocess.Process | ForkedProcess
    log_path: str
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.info["url"]


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


async def _exec(args: list[str], env: dict[str, str], log: IO[bytes]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tract_async.serving", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=log, env=env, start_new_session=True)


async def _fork(args: list[str], env: dict[str, str], log: IO[bytes]) -> ForkedProcess:
    """Fork the service from the warm zygote (tract_async.serving.zygote): stdin /dev/null,
    stdout a pipe read here, stderr the log. Raises ZygoteError."""
    z = zygote()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    r, w = os.pipe()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                                os.fdopen(r, "rb", buffering=0))
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        return await z.spawn(args, env=env, stdin=devnull, stdout=w, stderr=log.fileno(),
                             stdout_reader=reader)
    except BaseException:
        transport.close()
        raise
    finally:
        os.close(devnull)
        os.close(w)


async def spawn_service(cfg: ServiceConfig, *, log_path: str, env: dict[str, str] | None = None,
                        start_timeout_s: float = 120.0, launch: str | None = None) -> ServiceProcess:
    """Start one service and wait for its ready line.

    ``launch``: ``"exec"`` (a fresh ``python -m tract_async.serving``), ``"fork"`` (forked from
    the warm zygote: ~4.5 CPU-s of imports fewer; CPU services only) or ``"auto"`` (fork where
    it may); None reads ``TRACT_SERVICE_LAUNCH`` (default auto). See
    :mod:`tract_async.serving.zygote`. A zygote that cannot fork (it died, or refused) is
    logged and the service is exec'd.

    Raises ServiceStartFailed: it exited, or said nothing within ``start_timeout_s``; the message
    carries the end of its log. The process is stopped before the error is raised.
    """
    args = config_to_argv(cfg)
    full_env = {**os.environ, **(env or {})}
    proc: asyncio.subprocess.Process | ForkedProcess
    with open(log_path, "ab") as log:
        if use_fork(launch, cfg.device):
            try:
                proc = await _fork(args, full_env, log)
            except ZygoteError as e:
                logger.warning("tract: the %s service is exec'd: %s", cfg.role, e)
                proc = await _exec(args, full_env, log)
        else:
            proc = await _exec(args, full_env, log)
    sp = ServiceProcess(role=cfg.role, proc=proc, log_path=log_path)
    try:
        async with asyncio.timeout(start_timeout_s):
            while True:
                assert proc.stdout is not None
                line = (await proc.stdout.readline()).decode(errors="replace")
                if not line:
                    code = await proc.wait()
                    raise ServiceStartFailed(f"{cfg.role} exited with status {code} before it was "
                                             f"ready; the end of {log_path}:\n{_log_tail(log_path)}")
                if line.startswith(READY_PREFIX):
                    sp.info = json.loads(line[len(READY_PREFIX):])
                    return sp
    except TimeoutError:
        await stop_service(sp, timeout_s=5.0)
        raise ServiceStartFailed(f"{cfg.role} did not report ready within {start_timeout_s} s; the "
                                 f"end of {log_path}:\n{_log_tail(log_path)}") from None
    except BaseException:
        await asyncio.shield(stop_service(sp, timeout_s=5.0))
        raise


async def stop_service(sp: ServiceProcess, *, timeout_s: float = 10.0) -> int | None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL. Returns the exit status. Idempotent."""
    proc = sp.proc
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode


class Rack:
    """A region (for region modes) and the three services of one mode, on loopback.

    ``async with Rack(mode=..., region=path, log_dir=..., **service options) as rack:`` then
    ``rack.router_url``; everything is stopped and the region removed on exit.
    """

    def __init__(self, *, mode: str, region: str | None, log_dir: str, start_timeout_s: float = 120.0,
                 stop_timeout_s: float = 10.0,
                 role_options: dict[str, dict[str, Any]] | None = None,
                 env: dict[str, str] | None = None, launch: str | None = None,
                 **options: Any) -> None:
        """``options`` go to every service's ServiceConfig; ``role_options`` override them for
        one role, e.g. ``{"prefill": {"device": "cuda:0"}, "decode": {"device": "cuda:1"}}``
        to put the two workers on separate GPUs. ``env`` is added to every service's
        environment (the nixl rows' ``UCX_TLS``). ``launch``: how each service starts
        (:func:`spawn_service`: exec, fork from the warm zygote, or auto)."""
        unknown = set(role_options or ()) - {"prefill", "decode", "router"}
        if unknown:
            raise ValueError(f"role_options for unknown roles {sorted(unknown)}")
        self.role_options = {k: dict(v) for k, v in (role_options or {}).items()}
        self.mode = mode
        self.region = region if mode in REGION_MODES else None
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.launch = launch
        self.options = options
        self.services: list[ServiceProcess] = []
        self._env: dict[str, str] = dict(env or {})
        self._stopped = False

    def _cfg(self, role: str, **extra: Any) -> ServiceConfig:
        opts = {**self.options, **self.role_options.get(role, {})}
        return ServiceConfig(role=role, mode=self.mode, region=self.region, die_with_parent=True,
                             **opts, **extra)

    def _log(self, role: str) -> str:
        return os.path.join(self.log_dir, f"{self.mode}-{role}.log")

    async def start(self) -> None:
        """Raises ServiceStartFailed (after stopping whatever had started)."""
        os.makedirs(self.log_dir, exist_ok=True)
        if self.mode == "http" or self.mode in NET_MODES:
            self._env[SECRET_ENV] = os.urandom(32).hex()
        try:
            if self.mode in NET_MODES:
                spawned = await self._start_peered_workers()
            else:
                spawned = await asyncio.gather(
                    spawn_service(self._cfg("prefill", node_id=0,
                                            create_region=self.region is not None),
                                  log_path=self._log("prefill"), env=self._env,
                                  start_timeout_s=self.start_timeout_s, launch=self.launch),
                    spawn_service(self._cfg("decode", node_id=1), log_path=self._log("decode"),
                                  env=self._env, start_timeout_s=self.start_timeout_s, launch=self.launch),
                    return_exceptions=True)
            self.services.extend(s for s in spawned if isinstance(s, ServiceProcess))
            for s in spawned:
                if isinstance(s, BaseException):
                    raise s
            prefill, decode = spawned
            self.services.append(await spawn_service(
                self._cfg("router", prefill_url=prefill.url, decode_url=decode.url),
                log_path=self._log("router"), env=self._env, start_timeout_s=self.start_timeout_s, launch=self.launch))
        except BaseException:
            await asyncio.shield(self.stop())
            raise

    async def _start_peered_workers(self) -> list[Any]:
        """Network modes: the prefill first, then the decode naming the prefill's engine as its
        peer (``kv_peers``; peering is symmetric, so the prefill then announces to it)."""
        prefill = await spawn_service(self._cfg("prefill", node_id=0), log_path=self._log("prefill"),
                                      env=self._env, start_timeout_s=self.start_timeout_s, launch=self.launch)
        self.services.append(prefill)
        url = prefill.info.get("engine_url")
        if not url:
            raise ServiceStartFailed(f"the {self.mode} prefill reported no engine_url: {prefill.info}")
        decode = await spawn_service(self._cfg("decode", node_id=1, kv_peers=url),
                                     log_path=self._log("decode"), env=self._env,
                                     start_timeout_s=self.start_timeout_s, launch=self.launch)
        self.services.remove(prefill)      # start() adds both
        return [prefill, decode]

    @property
    def router_url(self) -> str:
        return self._by_role("router").url

    def url_of(self, role: str) -> str:
        """The URL of the started service of ``role`` (its ``/health`` carries engine counters).

        Raises KeyError: no such service has started.
        """
        return self._by_role(role).url

    def _by_role(self, role: str) -> ServiceProcess:
        for s in self.services:
            if s.role == role:
                return s
        raise KeyError(role)

    async def stop(self) -> list[str]:
        """Stop the services (router, decode, prefill) and remove the region. Idempotent.

        Returns problems seen (a service that needed SIGKILL or exited non-zero), never raises
        for them: cleanup must finish.
        """
        if self._stopped:
            return []
        self._stopped = True
        problems: list[str] = []
        order = {"router": 0, "decode": 1, "prefill": 2}
        for sp in sorted(self.services, key=lambda s: order[s.role]):
            code = await stop_service(sp, timeout_s=self.stop_timeout_s)
            if code not in (0, -signal.SIGTERM):
                problems.append(f"{sp.role} exited with status {code} (log {sp.log_path})")
        if self.region:
            from tract_async.region.region import discard
            discard(self.region)
        return problems

    async def __aenter__(self) -> Rack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.shield(self.stop())
