import cProfile, pstats, asyncio, sys, os, importlib
sys.argv = ["x", "1"]
os.environ.pop("STEPS", None)
src = open("/work/main/bench/results/vm-20261207-s50/stream_py.py").read()
g = {"__name__": "scan"}
exec(compile(src, "stream_py", "exec"), g)
pr = cProfile.Profile(); pr.enable()
asyncio.run(g["main"](1, False))
pr.disable()
import numba
from numba.core.registry import CPUDispatcher
seen = set()
st = pstats.Stats(pr)
names = {(fn, name) for (fn, line, name) in st.stats}
# map (file, name) to dispatchers
for mod in list(sys.modules.values()):
    f = getattr(mod, "__file__", None) or ""
    if "tract" not in f and "kernels" not in f: continue
    for k, v in list(vars(mod).items()):
        if isinstance(v, CPUDispatcher):
            pf = v.py_func.__code__.co_filename
            if (pf, v.py_func.__name__) in names and (pf, k) not in seen:
                seen.add((pf, k))
                print(("NOGIL " if v.targetoptions.get("nogil") else "held  ") + f"{os.path.relpath(pf, '/work/main')}:{v.py_func.__name__}")
