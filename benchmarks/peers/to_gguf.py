"""A Hugging Face checkpoint directory as a GGUF file, by llama.cpp's own converter
(convert_hf_to_gguf.py and its gguf-py, from the tree install_llama_cpp.sh unpacked), so that
llama-server serves the very weights tokenmill and vLLM load.

    python benchmarks/peers/to_gguf.py MODEL_DIR OUT.gguf [--outtype bf16|f16|f32|q8_0]

The converter runs in the tree's venv (install_llama_cpp.sh: tokenmill's torch, numpy,
safetensors and transformers, and sentencepiece), or with this python where there is none.
side_by_side.py calls it when --only names llamacpp and no --gguf is given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.*
from benchmarks.peers.launch import LLAMA_CPP, require  # noqa: E402


def convert(model: Path, out: Path, outtype: str = "bf16", tree: Path = LLAMA_CPP) -> Path:
    """`model` converted into `out` (its folder made) at `outtype`."""
    script = tree / "convert_hf_to_gguf.py"
    require(script, "run benchmarks/peers/install_llama_cpp.sh (or set LLAMA_CPP)")
    out.parent.mkdir(parents=True, exist_ok=True)
    venv = tree / "venv" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    command = [python, str(script), str(model), "--outtype", outtype, "--outfile", str(out)]
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    print(f"converting {model} to {out} ({outtype}) ...", flush=True)
    subprocess.run(command, check=True, env=env)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--outtype", default="bf16", help="bf16, f16, f32 or q8_0 (bf16)")
    p.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP, help=f"the tree ({LLAMA_CPP})")
    args = p.parse_args()
    convert(args.model, args.out, args.outtype, args.llama_cpp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
