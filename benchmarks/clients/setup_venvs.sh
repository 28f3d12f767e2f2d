#!/usr/bin/env bash
# One venv per client library (each alone, as its users install it) for run_probe.py.
#   benchmarks/clients/setup_venvs.sh [DIR]   (default /work/probe-venvs)
set -euo pipefail
dir=${1:-/work/probe-venvs}
mkdir -p "$dir"
make_venv() {  # NAME PACKAGE...
    local name=$1; shift
    [[ -x "$dir/$name/bin/python" ]] || python3 -m venv "$dir/$name"
    "$dir/$name/bin/pip" install -q "$@"
}
make_venv openai-3.63 openai==3.63.0 pydantic
make_venv openai-3.3 openai==3.3.0 pydantic
make_venv instructor "instructor==1.17.*"
make_venv langchain-openai "langchain-openai==1.8.*"
make_venv pydantic-ai "pydantic-ai-slim[openai]==2.78.*"
make_venv openai-agents "openai-agents==0.24.*"
make_venv litellm "litellm==1.110.*"
make_venv inspect-ai "inspect-ai==0.3.285" openai
