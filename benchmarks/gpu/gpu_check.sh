#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the `run` device tool, with carry [".whl"]):
# installs what the image lacks from the carried wheels (.whl/: msgspec, pyzmq and
# llguidance for Python 3.12, `pip download --no-deps`; see the device README), links
# tokenmill's folders into an importable tree, then runs benchmarks/gpu/gpu_check.py (attention
# backends agree; an 8B Llama shape with dummy weights: decode step against reading weights and KV
# once, tok/s with and without top-5, prefill TFLOP/s) after benchmarks/gpu/gpu_linear.py (the
# Triton linear kernel against cuBLAS), each stage under a time limit. Output in $OUT.
#   run: bash benchmarks/gpu/gpu_check.sh        (timeout_s 540 leaves a rerun's worth of time)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    # NOTE: the image has no msgspec, pyzmq or llguidance; a failed `pip install -e .` there
    # (first lent GPU, 2026-12-04) left tokenmill unimportable, so the package is a tree of
    # links to the top-level folders instead: nothing is built or installed.
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    mkdir -p /tmp/tm/tokenmill
    for d in cli controller detokenizer frontend protocol tp_worker; do
        ln -sfn "$PWD/$d" "/tmp/tm/tokenmill/$d"
    done
    export PYTHONPATH=/tmp/tm:/tmp/site PYTHONUNBUFFERED=1
    timeout 150 python benchmarks/gpu/gpu_linear.py --out "$OUT" \
        --configs "${GPU_LINEAR_CONFIGS:-128x128x64x8x3,64x128x64x4x4,64x256x64x8x3}"
    echo "gpu_linear.py exit status: $?"
    timeout 360 python benchmarks/gpu/gpu_check.py --device cuda --out "$OUT"
    echo "gpu_check.py exit status: $?"
    timeout 180 python benchmarks/gpu/gpu_profile.py --out "$OUT"
    echo "gpu_profile.py exit status: $?"
} 2>&1 | tee "$OUT/gpu_check.txt"
