#!/usr/bin/env bash
# Sizes of fresh venvs of this checkout, the README's install figures:
#   core     pip install .                      (no torch: numpy arrays, tract_async/arrays.py)
#   torch    + torch==2.13.0 (the CPU build)    pip install ".[torch]"
#   serve    + the serving stack                pip install ".[serve]"  (what the README installs)
# In the core venv it also runs a put/get of numpy arrays, `tract region init/fsck` and checks
# that torch is not importable there. Prints a table; exit 1 if the core venv is over 500 MiB or
# its smoke test fails. Takes a few minutes (three installs from pip's cache or local disk).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d /tmp/tract-venv-size.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
LIMIT_MIB=500

mk() {  # mk NAME PIP-ARGS...: a venv with the checkout installed (not editable: a real install)
  local name=$1; shift
  python3 -m venv "$WORK/$name"
  "$WORK/$name/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$WORK/$name/bin/python" -m pip install -q "$@" >"$WORK/$name.log" 2>&1 \
    || { echo "install of $name failed:"; tail -20 "$WORK/$name.log"; exit 1; }
  du -sm "$WORK/$name" | cut -f1          # as installed, bytecode (pip compiles it) included
}

core=$(mk core "$ROOT")
path=/dev/shm/tract-venvsize-$$
NUMBA_CACHE_DIR="$WORK/numba" "$WORK/core/bin/python" - "$path" <<'PY'
import asyncio, importlib.util, sys
import numpy as np
assert importlib.util.find_spec("torch") is None, "torch is installed in the core venv"
import tract_async as tract

async def main(path):
    lay = tract.KVLayout(num_layers=2, block_tokens=4, kv_heads=1, head_dim=8)
    cfg = tract.EngineConfig(layout=lay, region=path, region_bytes=8 << 20, create=True,
                             remove_on_close=True)
    async with tract.Engine.open(cfg) as eng:
        keys = eng.block_keys(range(8))
        kv = np.arange(np.prod(lay.kv_shape(2)), dtype=np.uint16).reshape(lay.kv_shape(2))
        await eng.put_kv(keys, kv)
        assert np.array_equal(await eng.get_kv(keys), kv)
asyncio.run(main(sys.argv[1]))
print("core venv: put/get of numpy arrays OK, torch absent")
PY
"$WORK/core/bin/tract" region init "$path" --size 8M >/dev/null
"$WORK/core/bin/tract" region fsck "$path" >/dev/null
"$WORK/core/bin/tract" region rm "$path" --force >/dev/null
rm -f "$path"

torch_mib=$(mk torch torch==2.13.0 "$ROOT[torch]")
serve_mib=$(mk serve torch==2.13.0 "$ROOT[serve]")
verdict=$([ "$core" -le "$LIMIT_MIB" ] && echo "<= $LIMIT_MIB MiB: met" || echo "> $LIMIT_MIB MiB: NOT met")
printf '%-28s %8s\n' "venv" "MiB"
printf '%-28s %8s  %s\n' "core (pip install .)" "$core" "$verdict"
printf '%-28s %8s\n' "core + torch 2.13.0 (CPU)" "$torch_mib"
printf '%-28s %8s\n' "core + [serve]" "$serve_mib"
[ "$core" -le "$LIMIT_MIB" ]
