import re, sys
from tract_async.tools.warmup import warm_up; warm_up(backends=("hw",), jobs=1)
from tract_async.kernel_cache import _engine_dispatchers
for d in _engine_dispatchers():
    name = d.py_func.__module__ + "." + d.py_func.__qualname__
    if name not in ("tract_async.region.index.lookup_batch", "tract_async.region.index.reserve_batch"):
        continue
    for sig, cres in d.overloads.items():
        lib = cres.library
        ir = lib.get_llvm_str()
        defs = re.findall(r"^define [^@]*@\"?([^\"(]+)", ir, re.M)
        print(name, len(ir), "defines", len(defs))
        for x in defs: print("   ", x[:110])
        asm = lib.get_asm_str()
        print("   asm bytes", len(asm), "instructions", len(re.findall(r"^\s+[a-z]", asm, re.M)))
