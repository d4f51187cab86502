#!/usr/bin/env bash
# The wheels a lent GPU host lacks, for bench/gpu_suite.sh: pytest, pytest-asyncio,
# pytest-timeout, cbor2, orjson (and what they need) for the host image's Python (3.12,
# x86_64 manylinux), into .whl/ (ignored by git; pass it to a device call as carry: [".whl"]).
# gpu_suite.sh installs from .whl/ only what does not import there. NIXL (for the nixl rows and
# tests) travels apart, as an xz tarball of its installed files in .whlnixl/ (gpu_suite.sh's
# header says how it is made); this script does not build it.
#   bash bench/device_kit.sh [PYTHON_VERSION]      # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
mkdir -p .whl
python3 -m pip download -q -d .whl --only-binary=:all: --python-version "$PYV" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  pytest pytest-asyncio pytest-timeout cbor2 orjson
ls .whl
du -sh .whl
