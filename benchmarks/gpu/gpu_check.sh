#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the `run` device tool, with carry [".whl"]):
# installs what the image lacks from the carried wheels (.whl/: msgspec, pyzmq and
# llguidance for Python 3.12, `pip download --no-deps`; see benchmarks/README.md), links
# tokenmill's folders into an importable tree, then runs benchmarks/gpu/gpu_accept.py (one
# PASS / FAIL table: bit-equality of every Triton kernel and of an 8B dummy model across
# batch, chunking, verify and placement; host syncs a step; speed against the read-once
# and bare-product bounds, the previous kernels beside the new; KV sizing), under a time
# limit; GPU_PROFILE=1 adds benchmarks/gpu/gpu_profile.py (where a step's device time goes).
# Output in $OUT. Extra arguments go to gpu_accept.py (e.g. --only kernels,model).
#   run: bash benchmarks/gpu/gpu_check.sh        (timeout_s 560; the run takes ~6-8 minutes)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # NOTE: the image has no msgspec, pyzmq or llguidance; a failed `pip install -e .` there
    # (first lent GPU, 2026-12-04) left tokenmill unimportable, so the package is a tree of
    # links to the top-level folders instead: nothing is built or installed.
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    mkdir -p /tmp/tm/tokenmill
    for d in cli controller detokenizer frontend offline protocol tp_worker; do
        ln -sfn "$PWD/$d" "/tmp/tm/tokenmill/$d"
    done
    export PYTHONPATH=/tmp/tm:/tmp/site PYTHONUNBUFFERED=1
    timeout "${GPU_ACCEPT_TIMEOUT:-520}" python benchmarks/gpu/gpu_accept.py --out "$OUT" "$@"
    echo "gpu_accept.py exit status: $?"
    if [ "${GPU_PROFILE:-0}" = 1 ]; then
        timeout 180 python benchmarks/gpu/gpu_profile.py --out "$OUT"
        echo "gpu_profile.py exit status: $?"
    fi
} 2>&1 | tee "$OUT/gpu_check.txt"
