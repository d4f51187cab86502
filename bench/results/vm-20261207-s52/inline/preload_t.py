import time
t0 = time.perf_counter()
import tract_async, tract_kernels
from tract_async.kernel_cache import preload
t1 = time.perf_counter()
n = preload()
t2 = time.perf_counter()
print(f"import {t1-t0:.3f} s, preload {n} signatures {t2-t1:.3f} s")
