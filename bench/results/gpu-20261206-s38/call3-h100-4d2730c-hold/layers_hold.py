"""gpu_layers with index.SNAPSHOT_HOLD_GIL_KEYS set from $HOLD (diagnostic A/B)."""
import os, runpy, sys
import tract_async.region.index as ix
ix.SNAPSHOT_HOLD_GIL_KEYS = int(os.environ["HOLD"])
print("SNAPSHOT_HOLD_GIL_KEYS =", ix.SNAPSHOT_HOLD_GIL_KEYS, flush=True)
sys.argv = ["gpu_layers.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "bench", "gpu_layers.py"), run_name="__main__")
