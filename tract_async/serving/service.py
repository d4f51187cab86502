"""What every serving process shares: its configuration, its model, its engine, its life cycle.

A service (prefill worker, decode worker, router) is one aiohttp application run by
:func:`serve`: bind ``host:port`` (port 0: the OS picks), print one ``TRACT-READY {json}`` line
on stdout (how a launcher learns the port), serve until SIGTERM or SIGINT, then clean up in
reverse order of setup (aiohttp's ``cleanup_ctx``: background tasks, engine, agent, model) and
exit 0. With ``die_with_parent`` the kernel sends SIGTERM when the launching process dies
(``PR_SET_PDEATHSIG``), so even a SIGKILLed ``tract demo`` leaves no worker behind.

Resources live in the application under typed ``web.AppKey``s, created in ``cleanup_ctx``
generators so that a failed start releases what was already built.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from tract_async.serving.errors import ServiceConfigError
from tract_async.serving.protocol import now as protocol_now
from tract_async.serving.protocol import (READY_PREFIX, REGION_MODES, ROLES, SECRET_ENV,
                                          SERVING_MODES)

MODELS = ("tiny", "llama3-8b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Configuration of one service; every field has a command-line flag (``add_arguments``).

    Two fields exist because a worker runs its model on a thread beside the event loop, and
    both need the GIL: the model thread launches kernels, the loop reads and writes KV layers.
    ``wait_spin_us`` (``EngineConfig.wait_spin_us``) is 0: an engine wait or a transfer's
    completion does not spin on the loop, because a spinning loop holds the GIL the model
    thread needs (the engine's default spins up to 2 ms on a GPU host, for a latency that a
    worker's layer reads, milliseconds apart, do not need). ``switch_interval_us`` bounds how
    long either thread waits for the GIL while the other runs Python (CPython's default is
    5 ms). On the H100 serving run of 2026-12-06 at 3aec45b (``bench/results/gpu-20261206-s38``)
    the decode worker, reading queued requests' layers while it generated, had a TPOT 19 %
    above rdma-model's, and layers of the request it streamed reached it 50-115 ms after their
    publication.

    ``first_pass`` is what a decode worker with nobody decoding does with a request whose
    prefill is still producing layers: ``extend`` (the default) waits for every layer and then
    runs the batch decoder's extend (one graph replay); ``stream`` computes its first pass layer
    by layer as the KV lands (only the last layer's compute is left when it arrives, but the
    pass runs transformers' Python beside the prefill on a shared GPU). A request joining a
    running batch always extends. On one H100 at 718a1e2, two runs in a row, chat: TTFT mean
    247.0 / 491.9 ms (0.54 req/s / 4 clients) with extend against 298.7 / 560.4 with stream
    (``bench/results/gpu-20261206-s39``, call 4)."""

    role: str
    mode: str = "region-cache"
    host: str = "127.0.0.1"
    port: int = 0
    # the model (prefill and decode)
    model: str = "tiny"
    tiny_layers: int = 4
    seed: int = 0
    device: str = "cpu"
    dtype: str | None = None          # default: the config's (fp32 tiny, bf16 8B)
    block_tokens: int = 16
    torch_threads: int | None = None
    attn: str = "auto"                # auto: sdpa on a CUDA device, eager on the CPU
    cudnn_attention: bool = False     # sdpa may pick cuDNN's kernels (off: see load_model)
    decode_batch: int = 8             # decode: requests one step serves (0: one at a time)
    decode_max_len: int = 9216        # decode: tokens (prompt + generated) a batch slot holds
    first_pass: str = "extend"        # decode, idle: extend or stream (layer by layer), see below
    # the region (region modes)
    region: str | None = None
    region_bytes: int = 256 << 20
    create_region: bool = False
    node_id: int = 0
    max_nodes: int = 8
    liveness_timeout_s: float = 5.0
    kv_peers: str | None = None       # nixl mode, decode: the prefill engine's URL(s), comma-separated
    early_reads: int = 4              # decode: requests that read before their compute slot
    wait_spin_us: int = 0             # engine waits spin this long on the loop (see below)
    switch_interval_us: float = 500.0  # sys.setswitchinterval of a worker process (see below)
    # the HTTP agent (http mode)
    kv_pool_bytes: int = 64 << 20
    kv_pool_device: str = "auto"      # nixl mode: the pool's memory (auto: the model's device)
    nixl_progress_thread: str = "auto"  # nixl mode: NIXL's own progress thread (see below)
    kv_hold_s: float = 60.0           # an un-READ span is freed after this long
    # the RDMA model (rdma-model mode; constants documented in serving/rdma_model.py)
    rdma_gbps: float = 25.0
    rdma_latency_us: float = 20.0
    # deadlines
    layer_timeout_s: float = 30.0     # decode: wait for one layer's KV
    request_timeout_s: float = 120.0  # router: one whole request
    # the router's workers
    prefill_url: str | None = None
    decode_url: str | None = None
    die_with_parent: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ServiceConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.mode not in SERVING_MODES:
            raise ServiceConfigError(f"mode must be one of {SERVING_MODES}, got {self.mode!r}")
        if self.model not in MODELS:
            raise ServiceConfigError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.role != "router" and self.mode in REGION_MODES and not self.region:
            raise ServiceConfigError(f"mode {self.mode!r} needs --region (a path in /dev/shm)")
        if self.role == "router" and not (self.prefill_url and self.decode_url):
            raise ServiceConfigError("the router needs --prefill-url and --decode-url")
        if self.block_tokens <= 0:
            raise ServiceConfigError(f"block_tokens must be positive, got {self.block_tokens}")
        if self.attn not in ("auto", "eager", "sdpa"):
            raise ServiceConfigError(f"attn must be auto, eager or sdpa, got {self.attn!r}")
        if self.first_pass not in ("stream", "extend"):
            raise ServiceConfigError(f"first_pass must be stream or extend, got {self.first_pass!r}")
        if self.nixl_progress_thread not in ("auto", "on", "off"):
            raise ServiceConfigError(f"nixl_progress_thread must be auto, on or off, got "
                                     f"{self.nixl_progress_thread!r}")
        if self.kv_pool_device not in ("auto", "cpu") and not self.kv_pool_device.startswith("cuda"):
            raise ServiceConfigError(f"kv_pool_device must be auto, cpu or cuda[:N], got "
                                     f"{self.kv_pool_device!r}")
        if self.decode_batch < 0 or self.decode_max_len < 2:
            raise ServiceConfigError(f"decode_batch must be >= 0 and decode_max_len >= 2, got "
                                     f"{self.decode_batch} and {self.decode_max_len}")
        if self.early_reads < 0:
            raise ServiceConfigError(f"early_reads must be >= 0, got {self.early_reads}")
        if self.wait_spin_us < 0 or not self.switch_interval_us > 0:
            raise ServiceConfigError(f"wait_spin_us must be >= 0 and switch_interval_us > 0, got "
                                     f"{self.wait_spin_us} and {self.switch_interval_us}")
        if self.rdma_gbps <= 0 or self.rdma_latency_us < 0:
            raise ServiceConfigError(f"the RDMA model needs rdma_gbps > 0 and rdma_latency_us >= 0, "
                                     f"got {self.rdma_gbps} and {self.rdma_latency_us}")

    @property
    def namespace(self) -> str:
        """Engine namespace: blocks of different models or weights never mix."""
        return f"{self.model}-L{self.tiny_layers if self.model == 'tiny' else 32}-seed{self.seed}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags for every :class:`ServiceConfig` field (``--kebab-case``)."""
    p.add_argument("role", choices=ROLES)
    for f in dataclasses.fields(ServiceConfig):
        if f.name == "role":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        elif f.name in ("dtype", "region", "prefill_url", "decode_url", "kv_peers"):
            p.add_argument(flag, default=default)
        elif f.name == "torch_threads":
            p.add_argument(flag, type=int, default=default)
        else:
            p.add_argument(flag, type=type(default), default=default)


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    names = {f.name for f in dataclasses.fields(ServiceConfig)}
    return ServiceConfig(**{k: v for k, v in vars(args).items() if k in names})


def config_to_argv(cfg: ServiceConfig) -> list[str]:
    """The command line that rebuilds ``cfg`` (what the launcher runs)."""
    out = [cfg.role]
    for f in dataclasses.fields(ServiceConfig):
        if f.name == "role":
            continue
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                out.append(flag)
        elif value is not None and value != f.default:
            out += [flag, str(value)]
    return out


# --- model and engine ---------------------------------------------------------------------------
def model_config(cfg: ServiceConfig) -> Any:
    from tract_async.serving.model import llama3_8b_config, tiny_llama_config
    if cfg.model == "tiny":
        return tiny_llama_config(num_layers=cfg.tiny_layers)
    return llama3_8b_config()


def torch_dtype(cfg: ServiceConfig) -> Any:
    import torch
    if cfg.dtype is None:
        return None
    dt = getattr(torch, cfg.dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ServiceConfigError(f"unknown dtype {cfg.dtype!r}")
    return dt


def load_model(cfg: ServiceConfig) -> Any:
    """The worker's model: seeded random weights, identical in every worker of the run."""
    import torch
    from tract_async.serving.model import allow_cudnn_attention, build_model
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    init_device = "cuda" if cfg.device.startswith("cuda") else "cpu"
    attn = attn_implementation(cfg)
    if attn == "sdpa" and init_device == "cuda":
        # no cuDNN attention unless asked: a graph build per new prompt length inside the
        # prefill (model.allow_cudnn_attention says why); the worker's process is the model's
        allow_cudnn_attention(cfg.cudnn_attention)
    return build_model(model_config(cfg), cfg.seed, cfg.device, torch_dtype(cfg),
                       init_device=init_device, attn=attn)


def attn_implementation(cfg: ServiceConfig) -> str:
    """The model's attention: ``cfg.attn``, where ``auto`` is SDPA on a CUDA device (flash or
    memory-efficient kernels: prefill of 4K tokens at 49 % of the H100's bf16 peak against 17 %
    eager, ``bench/results/gpu-20261206-s39/call1-model-speed-h100-fd2819f.json``) and eager on
    the CPU (the arithmetic the CPU tests compare against)."""
    if cfg.attn != "auto":
        return cfg.attn
    return "sdpa" if cfg.device.startswith("cuda") else "eager"


def kv_layout(cfg: ServiceConfig, model: Any) -> Any:
    """The engine KVLayout of the model (dtype: the model's)."""
    import tract_async as tract
    from tract_async.serving.model import kv_layout_for
    geo = kv_layout_for(model.config, cfg.block_tokens)
    return tract.KVLayout(num_layers=geo.num_layers, block_tokens=geo.block_tokens,
                          kv_heads=geo.kv_heads, head_dim=geo.head_dim,
                          dtype=model.lm_head.weight.dtype)


def kv_pool_device(cfg: ServiceConfig) -> str:
    """Where a nixl worker's block pool lives: ``cfg.kv_pool_device``, where ``auto`` is the
    model's device. A GPU model with a pool in GPU memory puts and reads KV as the paper's NIXL
    baseline does (VRAM registered with NIXL, READ GPU to GPU); a host pool would add a
    pageable device-to-host copy per layer to the baseline's put and read (the 2026-12-06 run
    before this: 20 ms a 2 MiB layer)."""
    if cfg.kv_pool_device != "auto":
        return cfg.kv_pool_device
    return cfg.device if cfg.device.startswith("cuda") else "cpu"


def nixl_progress_thread(cfg: ServiceConfig) -> bool:
    """Whether a nixl worker's engine runs NIXL's own progress thread: ``on``, ``off``, or
    ``auto``: on where the host has 8 cores or more. Over TCP the holder of the pool must
    progress UCX to serve its peers' READs; without the thread a prefill worker does it from
    its event loop, between its own requests' work, and its READs were served at 0.11-0.25
    GB/s on the H100 host where NIXL alone moved 0.63 GB/s (``bench/results/gpu-20261206-s40``,
    calls 4 and 5). The thread spins (half a core or more, ``transport/nixl_agent.py``): worth
    it beside a GPU's 16 cores, not on the 2-core VM."""
    if cfg.nixl_progress_thread != "auto":
        return cfg.nixl_progress_thread == "on"
    return (os.cpu_count() or 1) >= 8


def engine_config(cfg: ServiceConfig, layout: Any) -> Any:
    import tract_async as tract
    from tract_async.serving.protocol import NET_MODES, engine_mode
    common = dict(layout=layout, node_id=cfg.node_id, max_nodes=cfg.max_nodes,
                  namespace=cfg.namespace, mode=engine_mode(cfg.mode),
                  liveness_timeout_s=cfg.liveness_timeout_s,
                  heartbeat_interval_s=min(0.1, cfg.liveness_timeout_s / 4),
                  wait_spin_us=cfg.wait_spin_us,
                  # a decode's last-layer read does not wait for the global lock to free what
                  # it consumed (BlockLifecycle.consume)
                  defer_consume=True)
    if cfg.mode in NET_MODES:
        # no region: the engine's pool and its agent on this host, peers named by the launcher
        # (the decode names the prefill; peering is symmetric); authenticated with the rack's
        # secret (SECRET_ENV)
        peers = tuple(u for u in (cfg.kv_peers or "").split(",") if u)
        extra = {}
        if cfg.mode == "nixl":
            extra["nixl_pool_device"] = kv_pool_device(cfg)
            extra["nixl_progress_thread"] = nixl_progress_thread(cfg)
        return tract.EngineConfig(**common, region=None, transport=cfg.mode,
                                  listen_host=cfg.host, listen_port=0, peers=peers,
                                  secret=agent_secret(), http_pool_bytes=cfg.kv_pool_bytes,
                                  **extra)
    chunk = 2 << 20
    while chunk < layout.block_bytes:
        chunk <<= 1
    return tract.EngineConfig(**common, region=cfg.region, region_bytes=cfg.region_bytes,
                              create=cfg.create_region, chunk_bytes=chunk)


def check_before_model(cfg: ServiceConfig) -> None:
    """What would make the worker's ``open_engine`` fail and can be known before its model is
    built (1-10 s of CPU on the 2-core VM): a region to create in a directory that does not
    exist (``RegionNotFound``, as ``Engine.open`` words it)."""
    if cfg.create_region and cfg.region:
        from tract_async.region.region import check_creatable
        check_creatable(cfg.region)


async def open_engine(cfg: ServiceConfig, layout: Any, *, attach_timeout_s: float = 60.0) -> Any:
    """Open the worker's Engine. An attaching worker (``create_region`` false) waits, up to
    ``attach_timeout_s``, for the creating worker to have made the region (they start together).

    Raises whatever ``Engine.open`` raises once the deadline has passed.
    """
    import tract_async as tract
    from tract_async.errors import RegionError
    ecfg = engine_config(cfg, layout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + attach_timeout_s
    delay = 0.02
    while True:
        try:
            engine = await tract.Engine.open(ecfg)
            break
        except RegionError:
            if cfg.create_region or loop.time() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)
    if cfg.device.startswith("cuda") and cfg.mode in REGION_MODES:
        await asyncio.to_thread(prepare_cuda, engine, cfg.device)
    return engine


def prepare_cuda(engine: Any, device: str) -> None:
    """Before serving, off the loop: register the region with CUDA (``cudaHostRegister`` of the
    whole mapping) and make the device's copier, which compiles its zero-copy kernel
    (``Copier.warm_zerocopy``); both would otherwise run inside a request's first put that
    needs them. Never raises: where this fails (no usable CUDA, a kernel that does not
    compile) it logs why and leaves it to the request that needs it, which then fails with the
    reason or takes another copy method."""
    import torch
    try:
        engine.cuda_setup().copier(torch.device(device))
    except Exception as e:  # noqa: BLE001 - a warm-up: the real call reports it
        logging.getLogger(__name__).warning("CUDA preparation of the region skipped: %s: %s",
                                            type(e).__name__, e)


class KVDevice:
    """Moves KV between the model's device and the engine, which may take CPU tensors only.

    The first CUDA tensor offered to ``put_kv`` tells: if the engine refuses it (TensorMismatch),
    every later put goes through ``.cpu()``; reads come back as CPU tensors and move to the
    model's device at the layer that uses them (``kv_cache.EngineLayer``). On a CPU model this is
    a plain pass-through.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.cuda_puts: bool | None = None   # unknown until the first CUDA tensor
        self._side_streams: dict[Any, Any] = {}  # device -> the stream puts copy on

    async def put_layer(self, keys: list[bytes], kv_layer: Any, layer: int | None,
                        events: list | None = None, ready: Any = None) -> int:
        """Store one layer (``layer`` None: every layer, ``kv_layer`` then holds them all).
        ``ready``: for a CUDA ``kv_layer``, the event after which it is complete
        (``streaming.PutLayer``); None records one on the current stream now.

        A CUDA layer is made contiguous on a side stream that waits for ``ready`` only, and the
        put's DMA waits for that copy only (``cuda.store.put_ready``): an event recorded on the
        compute stream at put time would also wait for every layer the compute thread queued
        since (the region-transfer stall of 2026-12-01: layer 2's DMA landed ~140 ms after it
        was enqueued). With ``events``, appends ``reserved_L`` and ``enqueued_L`` where the
        region store times its phases (``Engine.time_phases``), before the caller's ``put_L``."""
        from tract_async.errors import TensorMismatch
        if kv_layer.device.type == "cuda" and self.cuda_puts is not False:
            import torch

            from tract_async.cuda.store import put_ready
            dev = kv_layer.device
            if ready is None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(dev))
            side = self._side_streams.get(dev)
            if side is None:
                side = self._side_streams[dev] = torch.cuda.Stream(dev)
            side.wait_event(ready)
            with torch.cuda.stream(side):
                # the caller keeps kv_layer alive until this put has landed, after this copy
                kv = kv_layer.contiguous()
                done = torch.cuda.Event()
                done.record(side)
            # whatever reads kv on the current stream later (a full region's spill to the
            # network path copies it to the host there) runs after the copy; this waits for
            # layer `layer` only, not for the layers queued since
            torch.cuda.current_stream(dev).wait_event(done)
            try:
                t_ready = protocol_now()
                with put_ready(done):
                    n = await self.engine.put_kv(keys, kv, layer=layer)
                self.cuda_puts = True
                ph = getattr(getattr(self.engine, "_store", None), "phases", None)
                if events is not None and ph is not None:
                    took = ph.take()
                    t = t_ready + took.get("reserve_incl_lock", 0.0)
                    events.append((f"reserved_L{layer}", t))
                    events.append((f"enqueued_L{layer}", t + took.get("enqueue", 0.0)))
                return n
            except TensorMismatch:
                if self.cuda_puts:
                    raise
                self.cuda_puts = False
        if kv_layer.device.type != "cpu":
            kv_layer = kv_layer.cpu()
        return await self.engine.put_kv(keys, kv_layer.contiguous(), layer=layer)


# --- life cycle ---------------------------------------------------------------------------------
def set_pdeathsig(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for ``sig`` when the parent dies (Linux); no-op elsewhere. A service asks
    for SIGTERM; the zygote its services fork from (serving/zygote.py) for SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig)   # PR_SET_PDEATHSIG


def agent_secret() -> bytes | None:
    """The agents' shared secret from the environment (hex), or None."""
    raw = os.environ.get(SECRET_ENV)
    return bytes.fromhex(raw) if raw else None


def worker_app(cfg: ServiceConfig, role: str, key: "web.AppKey[Any]", worker: Any, route: str,
               handler: Callable[[web.Request], Any],
               resources: Callable[[web.Application], AsyncIterator[None]]) -> web.Application:
    """A prefill or decode worker's application: the worker under ``key``, its resources in
    ``cleanup_ctx`` (built when it starts), ``POST route``, ``GET /health``, ``GET /metrics``."""
    if cfg.role != role:
        raise ValueError(f"build_app for the {role} worker got role {cfg.role!r}")
    from tract_async.serving.metrics import metrics_handler

    async def handle_health(request: web.Request) -> web.Response:
        return web.json_response(request.app[key].health())

    app = web.Application(client_max_size=64 << 20)
    app[key] = worker
    app.cleanup_ctx.append(resources)
    app.router.add_post(route, handler)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", metrics_handler(worker.metrics))
    return app


def agent_ready_info(worker: Any) -> dict[str, Any]:
    """What a worker adds to its ready line: its transfer agent and the agent's URL, if any, and
    its engine's own agent URL in the network modes (``engine_url``: the decode's peer)."""
    h = worker.health()
    out = {k: h[k] for k in ("agent", "agent_url") if k in h}
    url = getattr(getattr(worker, "engine", None), "url", None)
    if url:
        out["engine_url"] = url
    return out


async def serve(app: web.Application, cfg: ServiceConfig, *, ready_info: Callable[[web.Application], dict[str, Any]]
                | None = None, stop: asyncio.Event | None = None) -> None:
    """Run ``app`` until SIGTERM/SIGINT (or ``stop``), then clean up. Prints the ready line."""
    sys.setswitchinterval(cfg.switch_interval_us * 1e-6)   # see ServiceConfig
    parent = os.getppid()
    if cfg.die_with_parent:
        set_pdeathsig()
        if os.getppid() != parent:   # the parent died before prctl took effect
            return
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1]
        info = {"role": cfg.role, "mode": cfg.mode, "pid": os.getpid(), "host": cfg.host, "port": port,
                "url": f"http://{cfg.host}:{port}"}
        if ready_info is not None:
            info.update(ready_info(app))
        sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
        sys.stdout.flush()
        await stop.wait()
    finally:
        await runner.cleanup()


class TaskOwner:
    """Owns a service's background tasks (per-request releases, watchers): ``spawn`` keeps a
    reference until the task ends; ``close`` cancels what is left and waits for it. Unlike a
    TaskGroup, one failing task does not cancel the others: each is a separate request's
    business, and its error is logged by the service, not lost (``errors``)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.errors: list[BaseException] = []
        self._closed = False

    def spawn(self, coro: Any, *, name: str | None = None) -> asyncio.Task[Any]:
        if self._closed:
            coro.close()
            raise RuntimeError("TaskOwner is closed")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]

    async def close(self) -> None:
        """Cancel every task and wait until all have ended. Idempotent."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
