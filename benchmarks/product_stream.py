"""What each one-row product's start and end, and its pages, cost a decode token.

A C++ driver (product_stream.cpp, built here against the kernels' own library) streams a
token's one-row products from memory, alternated round by round: as the layer stack calls
them (each layer's q/k/v, o, gate/up and down, then the lm_head, each told the next) with
the weights on 4 KiB pages and on 2 MiB pages (as tp_worker/huge_pages.py lays the
server's), the same bytes as one product a kind (each kind's layers side by side), and a
two-thread read of 1 GiB (the floor's rate). As called over one product a kind is what a
product's parallel region, its first panels and its last panel's wait add; 4 KiB over 2 MiB
pages, what the TLB misses add. No attention, norms or serving: one_user.py has those.

    python benchmarks/product_stream.py [--model DIR | --preset medium] [--rounds 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from serving import demo_model

from tokenmill.cli.default_model import resolve_model
from tokenmill.tp_worker.cpu_kernels import _compiler, build
from tokenmill.tp_worker.cpu_ops import amx_enabled
from tokenmill.tp_worker.model_config import load_model_config

SOURCE = Path(__file__).with_name("product_stream.cpp")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir or GGUF file (default: SmolLM2)")
    p.add_argument("--preset", choices=("small", "medium"), help="a demo checkpoint instead")
    p.add_argument("--rounds", type=int, default=8, help="alternated rounds (8)")
    args = p.parse_args()
    model = demo_model(args.preset) if args.preset else resolve_model(args.model).directory
    c = load_model_config(model)
    with tempfile.TemporaryDirectory() as tmp:
        driver = Path(tmp) / "product_stream"
        command = [_compiler(), "-march=native", "-O2", "-fopenmp", str(SOURCE), "-ldl"]
        built = subprocess.run([*command, "-o", str(driver)], capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"product_stream.cpp did not build here:\n{built.stderr}")
        kernels = "AMX" if amx_enabled() else "AVX-512"
        name = args.preset or args.model or "SmolLM2-135M-Instruct"
        print(f"{name}: one-row bfloat16 products on the {kernels} kernels", flush=True)
        shape = (c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        sizes = (*shape, c.intermediate_size, c.num_layers, c.vocab_size, args.rounds)
        run = [str(driver), str(build()), str(int(amx_enabled())), *map(str, sizes)]
        return subprocess.run(run).returncode


if __name__ == "__main__":
    sys.exit(main())
