#!/usr/bin/env bash
# llama.cpp's own server, the CPU peer most people run on a CPU: llama-server and
# llama-quantize built from the llama.cpp source vendored in the llama-cpp-python 0.3.36
# source distribution (from the package registry, as everything here is), with
# convert_hf_to_gguf.py and gguf-py beside them for to_gguf.py, whose python is DIR/venv: this
# python's packages (torch, transformers, safetensors: tokenmill's environment) and
# sentencepiece, which the converter imports for a Llama vocabulary. About 5-8 minutes of two
# cores; needs cmake and g++.
#
#   bash benchmarks/peers/install_llama_cpp.sh [DIR]   (default ~/.cache/tokenmill-peers/llama.cpp)
#
# LLAMA_NO_AMX=1 builds for AVX-512 without AMX; it is the default where the CPU has AMX
# (LLAMA_NO_AMX=0 builds with it): on an AMX Xeon the AMX build segfaults loading quantized
# files (Q4_K_M, Q8_0) unless llama-server runs with --no-repack, and its bfloat16 path is no
# faster. The build is recorded in DIR/build-info.txt, which side_by_side.py prints.
set -euo pipefail
DIR=${1:-$HOME/.cache/tokenmill-peers/llama.cpp}
VERSION=0.3.36
if [ -z "${LLAMA_NO_AMX:-}" ]; then
  LLAMA_NO_AMX=$(grep -q amx_tile /proc/cpuinfo && echo 1 || echo 0)
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
rm -rf "$DIR"; mkdir -p "$(dirname "$DIR")"
mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR"
cd "$DIR"
isa=(-DGGML_NATIVE=ON)
if [ "$LLAMA_NO_AMX" = 1 ]; then
  isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
       -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -B build -DCMAKE_BUILD_TYPE=Release "${isa[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >build.log 2>&1
cmake --build build --target llama-server llama-quantize -j"$(nproc)" >>build.log 2>&1 \
  || { tail -20 build.log; exit 1; }
python3 -m venv --system-site-packages venv
venv/bin/pip install -q sentencepiece
{
  echo "llama.cpp from llama-cpp-python $VERSION's sdist; LLAMA_NO_AMX=$LLAMA_NO_AMX (${isa[*]})"
  build/bin/llama-server --version 2>&1 | grep -E "version|built" | tr '\n' ' '
  echo
} >build-info.txt
cat build-info.txt
echo "llama.cpp ready: LLAMA_SERVER=$DIR/build/bin/llama-server"
