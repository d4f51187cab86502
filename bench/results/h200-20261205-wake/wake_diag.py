"""Where a 64 KiB handoff's time goes on this host: the cost of an operation right after its
thread woke from a sleep (timer / pipe from another process), against back to back and against a
spinning wait; cross-process wake-up latency (pipe, blocking vs spinning reader); syscall costs.
Prints one JSON line per section."""
import asyncio, json, os, sys, time, multiprocessing as mp, select, socket
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import numpy as np

def facts():
    r = {}
    def rd(p):
        try: return open(p).read().strip()
        except Exception as e: return f"? {type(e).__name__}"
    r["uname"] = os.uname().release
    r["clocksource"] = rd("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    r["cpuidle_driver"] = rd("/sys/devices/system/cpu/cpuidle/current_driver")
    r["cpuidle_gov"] = rd("/sys/devices/system/cpu/cpuidle/current_governor_ro") if os.path.exists("/sys/devices/system/cpu/cpuidle/current_governor_ro") else rd("/sys/devices/system/cpu/cpuidle/current_governor")
    st = []
    d = "/sys/devices/system/cpu/cpu0/cpuidle"
    if os.path.isdir(d):
        for s in sorted(os.listdir(d)):
            st.append((rd(f"{d}/{s}/name"), rd(f"{d}/{s}/latency"), rd(f"{d}/{s}/usage")))
    r["idle_states"] = st
    for p in ("guest_halt_poll_ns", "guest_halt_poll_allow_shrink", "guest_halt_poll_grow"):
        r[p] = rd(f"/sys/module/haltpoll/parameters/{p}")
    r["model"] = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")][:1]
    r["mhz"] = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")][:4]
    r["flags_has"] = {f: (f in open("/proc/cpuinfo").read()) for f in (" hypervisor", " constant_tsc", " avx512f", " clflushopt", " clwb")}
    r["nproc"] = os.cpu_count()
    for p in ("transparent_hugepage/enabled", "transparent_hugepage/shmem_enabled"):
        r[p] = rd(f"/sys/kernel/mm/{p}")
    r["hugepages"] = [l.strip() for l in open("/proc/meminfo") if "Huge" in l]
    r["loadavg"] = rd("/proc/loadavg")
    return r

def med(ts): return round(float(np.median(ts)) / 1e3, 2)
def p90(ts): return round(float(np.percentile(ts, 90)) / 1e3, 2)

def syscalls():
    r = {}
    n = 20000
    t0 = time.perf_counter_ns()
    for _ in range(n): time.perf_counter_ns()
    r["perf_counter_ns"] = round((time.perf_counter_ns() - t0) / n, 1)
    t0 = time.perf_counter_ns()
    for _ in range(n): time.time_ns()
    r["time_ns"] = round((time.perf_counter_ns() - t0) / n, 1)
    t0 = time.perf_counter_ns()
    for _ in range(n): os.getppid()
    r["getppid"] = round((time.perf_counter_ns() - t0) / n, 1)
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    t0 = time.perf_counter_ns()
    for _ in range(n): os.eventfd_write(efd, 1)
    r["eventfd_write"] = round((time.perf_counter_ns() - t0) / n, 1)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.setblocking(False)
    t0 = time.perf_counter_ns()
    for _ in range(n // 10):
        try: s.sendto(b"", "\0tract-wake-diag-nobody")
        except OSError: pass
    r["sendto_missing_dgram"] = round((time.perf_counter_ns() - t0) / (n // 10), 1)
    t0 = time.perf_counter_ns()
    for _ in range(n // 10): os.sched_yield()
    r["sched_yield"] = round((time.perf_counter_ns() - t0) / (n // 10), 1)
    return r

# -- cross-process wake-up: a writes a stamp, b (blocking or spinning) stamps on receipt ---------
def _echo(rfd, wfd, spin):
    if spin: os.set_blocking(rfd, False)
    while True:
        if spin:
            while True:
                try: b = os.read(rfd, 8); break
                except BlockingIOError: pass
        else:
            b = os.read(rfd, 8)
        if not b or b == b"stopstop": return
        os.write(wfd, time.perf_counter_ns().to_bytes(8, "little"))

def pingpong(spin, reps=400, gap_s=0.0003):
    r1, w1 = os.pipe(); r2, w2 = os.pipe()
    p = mp.get_context("fork").Process(target=_echo, args=(r1, w2, spin)); p.start()
    lat = []
    for i in range(reps + 20):
        time.sleep(gap_s)
        t0 = time.perf_counter_ns(); os.write(w1, b"x" * 8)
        t1 = int.from_bytes(os.read(r2, 8), "little")
        if i >= 20: lat.append(t1 - t0)
    os.write(w1, b"stopstop"); p.join(5)
    return {"p50_us": med(lat), "p90_us": p90(lat)}

# -- an op after a wake ---------------------------------------------------------------------------
def _ticker(wfd, gap_s, n):
    for _ in range(n):
        t = time.perf_counter() + gap_s
        while time.perf_counter() < t: pass    # exact gap, then wake the waiter
        os.write(wfd, b"t")

def py_work():
    d = {}
    for i in range(40):
        d[i] = (i, str(i))
    return len(d)

async def after_wake(reps=300):
    from _putget.fixtures import BLOCK, det_keys, engine_cfg, make_kv, REGION_OVERHEAD
    import tract_async as tract
    import torch
    path = f"{os.environ.get('REGION_DIR', '/dev/shm')}/tract-wake-{os.getpid()}"
    out = {}
    try:
        async with tract.Engine.open(engine_cfg(path, 0, (8 * reps + 64) * BLOCK + REGION_OVERHEAD, True)) as eng:
            kv = make_kv(1); o = torch.empty_like(kv)
            a = np.ones(64 * 1024, np.uint8); b2 = np.zeros_like(a)
            ctr = iter(range(10 ** 9))
            gk = det_keys("g0", 0, 1)
            await eng.put_kv(gk, kv)
            async def put():
                await eng.put_kv(det_keys("w", next(ctr), 1), kv)
            async def get():
                await eng.get_kv(gk, out=o)
            async def npc():
                np.copyto(b2, a)
            async def pyw():
                py_work()
            async def noop():
                pass
            ops = {"noop": noop, "py_work": pyw, "np_copy_64K": npc, "put_kv_64K": put, "get_kv_64K": get}
            r, w = os.pipe()
            for wait in ("b2b", "spin300us", "sleep300us", "pipe300us_blocking", "pipe300us_epoll"):
                res = {}
                for name, op in ops.items():
                    ts = []
                    tick = None
                    if wait.startswith("pipe"):
                        tick = mp.get_context("fork").Process(target=_ticker, args=(w, 0.0003, reps + 10)); tick.start()
                    loop = asyncio.get_running_loop()
                    for i in range(reps + 10):
                        if wait == "spin300us":
                            t = time.perf_counter() + 0.0003
                            while time.perf_counter() < t: pass
                        elif wait == "sleep300us":
                            time.sleep(0.0003)
                        elif wait == "pipe300us_blocking":
                            os.read(r, 1)
                        elif wait == "pipe300us_epoll":
                            fut = loop.create_future()
                            loop.add_reader(r, lambda: fut.done() or fut.set_result(None))
                            try: await fut
                            finally: loop.remove_reader(r)
                            os.read(r, 1)
                        t0 = time.perf_counter_ns(); await op(); t1 = time.perf_counter_ns()
                        if i >= 10: ts.append(t1 - t0)
                    if tick is not None: tick.join(10)
                    res[name] = [med(ts), p90(ts)]
                out[wait] = res
                print(json.dumps({"after_wake": wait, **res}), flush=True)
    finally:
        if os.path.exists(path): os.unlink(path)
    return out

if __name__ == "__main__":
    if os.environ.get("ONLY_AFTER"):
        asyncio.run(after_wake()); sys.exit(0)
    print(json.dumps({"facts": facts()}), flush=True)
    print(json.dumps({"syscalls_ns": syscalls()}), flush=True)
    for spin in (False, True):
        for gap in (0.0003, 0.003):
            print(json.dumps({"pingpong": {"reader_spins": spin, "gap_s": gap, **pingpong(spin, gap_s=gap)}}), flush=True)
    asyncio.run(after_wake())
