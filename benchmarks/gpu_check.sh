#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (the `run` device tool, with carry [".whl"]):
# installs what the image lacks from the carried wheels (.whl/: msgspec, pyzmq,
# prometheus_client, openai and their dependencies, for Python 3.12), installs tokenmill
# without building anything else, then runs benchmarks/gpu_check.py (attention backends
# agree; an 8B Llama shape with dummy weights: decode step against reading weights and KV
# once, tok/s with and without top-5), each stage under a time limit. Output in $OUT.
#   run: bash benchmarks/gpu_check.sh        (timeout_s 540 leaves a rerun's worth of time)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
{
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    pip install -q --no-index --find-links .whl msgspec pyzmq prometheus_client 2>&1 | tail -1
    pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
    timeout 420 python benchmarks/gpu_check.py --device cuda --out "$OUT"
    echo "gpu_check.py exit status: $?"
} 2>&1 | tee "$OUT/gpu_check.txt"
