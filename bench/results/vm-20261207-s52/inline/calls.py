"""Count calls to other jitted functions left in the machine code of the engine's kernels."""
import re, sys, collections
import numpy as np
from tract_async.kernel_cache import preload, _engine_dispatchers
from tract_async.tools.warmup import warm_up; warm_up(backends=("hw",), jobs=1)
tot = collections.Counter()
nfun = 0
for d in _engine_dispatchers():
    for sig, cres in list(d.overloads.items()):
        try:
            asm = d.inspect_asm(sig)
        except Exception as e:
            continue
        nfun += 1
        jcalls = re.findall(r"movabsq\s+\$(_ZN\S+),", asm)
        own = d.py_func.__qualname__.split(".")[-1]
        jcalls = [c for c in jcalls if "NRT" not in c and "NumbaEnv" not in c and own not in c]
        name = d.py_func.__module__ + "." + d.py_func.__qualname__
        if jcalls:
            tot[name] += len(jcalls)
            if len(sys.argv) > 1:
                print(name, collections.Counter(jcalls).most_common(4))
print("functions", nfun, "with calls to jitted functions:", len(tot), "calls", sum(tot.values()))
for k, v in tot.most_common(25):
    print(v, k)
