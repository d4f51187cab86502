"""Per-function Numba compile time of the warm-up scenario (one process, cold cache)."""
import time, collections, sys
from numba.core import event
stack = []
tot = collections.Counter(); cnt = collections.Counter()
class L(event.Listener):
    def on_start(self, ev):
        stack.append((ev.data["dispatcher"].py_func.__module__ + "." + ev.data["dispatcher"].py_func.__qualname__, time.perf_counter()))
    def on_end(self, ev):
        name, t = stack.pop()
        dt = time.perf_counter() - t
        tot[name] += dt; cnt[name] += 1
        # subtract from parent (nested compiles)
        if stack:
            tot[stack[-1][0]] -= dt
event.register("numba:compile", L())
from tract_async.tools.warmup import warm_up
t0 = time.perf_counter()
warm_up(backends=("hw", "sim"), jobs=1)
print("total", time.perf_counter() - t0)
s = 0
for k, v in tot.most_common(60):
    s += v
    print(f"{v:7.2f} {cnt[k]:3d} {k}")
print("sum compile self", sum(tot.values()), "functions", len(tot), "compiles", sum(cnt.values()))
