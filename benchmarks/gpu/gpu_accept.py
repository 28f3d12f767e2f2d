"""The CUDA path's acceptance run on a lent GPU (benchmarks/gpu/gpu_check.sh runs it; at most
10 minutes on one H100): one PASS / FAIL table, written to gpu_accept.json after each stage.

Stages (`--only STAGE,...` reruns some):
  env      the device, torch and Triton; the copy bandwidth and a bare bfloat16 product's rate
  kernels  each Triton kernel at an 8B Llama's shapes: a row's bits alone = in batches of
           other sizes and tile shapes = at another place; attention's token alone = in a
           decode batch = in prompt chunks of three sizes = in speculation's verify = in many
           launches; torch's own row reductions beside them; the previous kernels (the first
           H200 run's choices) timed beside the new
  tiny     the tiny checkpoint end to end: Triton = SDPA, and each request alone = in a batch
  model    an 8B dummy model on Triton: one prompt's tokens and logprobs alone = among 63 =
           under two other chunkings = after a prefix-cache hit
  syncs    host syncs a decode step (torch's sync debug mode)
  speed    decode steps at 64 / 16 / 1 rows x 2,048 against reading weights and KV once; a
           4,096-token prefill against the bare product; top-5's cost
  kv       the KV cache sized by the profiling step, and 64 rows' peak over it

    python benchmarks/gpu/gpu_accept.py --out $OUT                      # on the GPU
    TRITON_INTERPRET=1 python benchmarks/gpu/gpu_accept.py --dry-run    # on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import (  # noqa: E402
    agreement,
    copy_bandwidth,
    engine,
    kv_sizing,
    product_rate,
    shaped_model,
    speed,
)

from tokenmill.cli.make_model import build_checkpoint  # noqa: E402
from tokenmill.offline.engine import OfflineEngine, OfflineRequest  # noqa: E402
from tokenmill.tp_worker.cuda import attention as attention_triton  # noqa: E402
from tokenmill.tp_worker.cuda import rowwise as rowwise_triton  # noqa: E402
from tokenmill.tp_worker.cuda.attention import plan_triton  # noqa: E402
from tokenmill.tp_worker.cuda.linear import TileConfig, k_slice, triton_linear  # noqa: E402
from tokenmill.tp_worker.model.layer_attention import LayerAttention  # noqa: E402

STAGES = ("env", "kernels", "tiny", "model", "syncs", "speed", "kv")
LLAMA_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 14336,
            "vocab": 128256}  # fmt: skip
DRY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96, "vocab": 300}


@dataclass
class Table:
    """The rows of the run: (check, value, target, verdict), printed as they come."""

    out: Path
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def check(self, name: str, ok: bool, value: str = "", target: str = "bit-equal") -> None:
        self._add(name, value or str(ok), target, "PASS" if ok else "FAIL")

    def reach(self, name: str, value: float, target: float, unit: str = "") -> None:
        verdict = "PASS" if value >= target else "FAIL"
        self._add(name, f"{value:.3f}{unit}", f">= {target:g}{unit}", verdict)

    def info(self, name: str, value: str) -> None:
        self._add(name, value, "", "info")

    def _add(self, name: str, value: str, target: str, verdict: str) -> None:
        self.rows.append((name, value, target, verdict))
        print(f"{verdict:5} {name}: {value} {target}", flush=True)
        self.save()

    def save(self) -> None:
        report = {"rows": self.rows, **self.facts}
        (self.out / "gpu_accept.json").write_text(json.dumps(report, indent=2))

    def print(self) -> None:
        width = max(len(r[0]) for r in self.rows)
        print("\n" + "=" * 30 + " gpu_accept " + "=" * 30)
        for name, value, target, verdict in self.rows:
            print(f"{verdict:5} {name:{width}}  {value:>22}  {target}")
        failed = sum(r[3] == "FAIL" for r in self.rows)
        passed = sum(r[3] == "PASS" for r in self.rows)
        print(f"{passed} passed, {failed} failed")


def timed_ms(fn: Callable[[], object], device: torch.device, repeat: int = 20) -> float:
    """The median of `repeat` calls after warm-up, with CUDA events (one call on the CPU)."""
    fn()
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - started)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def stage_env(t: Table, device: torch.device, dry: bool) -> tuple[float, float]:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t.info("device", f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    bandwidth = copy_bandwidth(device)
    rate = product_rate(device, torch.bfloat16 if not dry else torch.float32)
    t.info("copy bandwidth (read + write)", f"{bandwidth / 1e9:.0f} GB/s")
    t.info("bare bf16 product", f"{rate / 1e12:.0f} TFLOP/s")
    t.facts.update(device=name, copy_gb_s=bandwidth / 1e9, product_tflop_s=rate / 1e12)
    return bandwidth, rate


# -- kernels --------------------------------------------------------------------------------


def linear_cases(shape: dict) -> dict[str, tuple[int, int, str]]:
    """name: (out features, in features, kind) of an 8B Llama's products at TP=1."""
    h, d = shape["hidden"], shape["head_dim"]
    qkv = (shape["heads"] + 2 * shape["kv_heads"]) * d
    return {
        "qkv": (qkv, h, "plain"),
        "o (+ residual)": (h, shape["heads"] * d, "residual"),
        "gate_up (silu * up)": (shape["inter"], h, "glu"),
        "down (+ residual)": (h, shape["inter"], "residual"),
        "lm_head (float32)": (shape["vocab"], h, "logits"),
    }


def check_linear(t: Table, device: torch.device, shape: dict, rows_list: tuple[int, ...]) -> None:
    """Row 0's bits alone (a 16-row tile) = in every batch size (other tile shapes) = last in
    another batch = under the previous fixed 64 x 128 tile; the previous and new timed."""
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    previous = TileConfig(64, 128, k_slice(dtype))
    for name, (n, k, kind) in linear_cases(shape).items():
        w = torch.randn(2 * n if kind == "glu" else n, k, device=device, generator=g).to(dtype)
        w *= k**-0.5
        x = torch.randn(max(rows_list), k, device=device, generator=g).to(dtype)
        res = torch.randn(max(rows_list), n, device=device, generator=g)

        def run(a: torch.Tensor, cfg: TileConfig | None = None, r=None, *, kind=kind, w=w, res=res):
            if kind == "glu":
                return triton_linear(a, w, None, None, cfg, glu="silu")
            if kind == "residual":
                r = res[: len(a)] if r is None else r
                return triton_linear(a, w, None, None, cfg, residual=r)
            return triton_linear(a, w, None, torch.float32 if kind == "logits" else None, cfg)

        alone = run(x[:1])
        same = all(torch.equal(run(x[:rows])[:1], alone) for rows in rows_list)
        order = torch.cat([torch.arange(1, 9), torch.zeros(1, dtype=torch.long)]).to(device)
        moved = torch.equal(run(x[order], None, res[order])[-1:], alone)
        fixed = torch.equal(run(x[:1], previous), alone)
        t.check(f"linear {name}: alone = batches {rows_list}, moved, 64x128 tile", same and moved
                and fixed, f"{same}/{moved}/{fixed}")  # fmt: skip
        times = []
        for rows in rows_list:
            a = x[:rows]
            new = timed_ms(lambda a=a: run(a), device)
            before = partial(_previous_linear, a, w, kind, res, previous)
            old = timed_ms(before, device)
            times.append(f"{rows}: {old:.3f}->{new:.3f}")
        t.info(f"linear {name} ms previous->new", ", ".join(times))


def _previous_linear(
    x: torch.Tensor, w: torch.Tensor, kind: str, res: torch.Tensor, cfg: TileConfig
) -> torch.Tensor:
    """The first H200 run's layer: one tile shape, the epilogues in torch after rounding."""
    if kind == "glu":
        gate, up = triton_linear(x, w, None, None, cfg).float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype)
    if kind == "residual":
        return res[: len(x)] + triton_linear(x, w, None, torch.float32, cfg)
    return triton_linear(x, w, None, torch.float32 if kind == "logits" else None, cfg)


@dataclass(frozen=True)
class KvSetup:
    k: torch.Tensor  # [Hkv, slots, D]
    v: torch.Tensor
    table: torch.Tensor  # [R, width] int32, each row its own slots
    lengths: list[int]  # each row's context, its last token's position + 1
    q: torch.Tensor  # [R, width, Hq, D] a query for every position of every row


def kv_setup(device: torch.device, shape: dict, lengths: list[int]) -> KvSetup:
    g = torch.Generator(device=device).manual_seed(1)
    width = max(lengths)
    hkv, d, hq = shape["kv_heads"], shape["head_dim"], shape["heads"]
    slots = sum(lengths)
    k = torch.randn(hkv, slots, d, device=device, generator=g).to(torch.bfloat16)
    v = torch.randn(hkv, slots, d, device=device, generator=g).to(torch.bfloat16)
    table = torch.zeros(len(lengths), width, dtype=torch.int32, device=device)
    order = torch.randperm(slots, device=device, generator=g).int()
    used = 0
    for r, n in enumerate(lengths):
        table[r, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(lengths), width, hq, d, device=device, generator=g).to(torch.bfloat16)
    return KvSetup(k, v, table, lengths, q)


def planned(
    s: KvSetup, tokens: list[tuple[int, int, int]], **choices
) -> Callable[[], torch.Tensor]:
    """The step of `tokens` (row, first position, count), planned once from host arrays as
    the runner plans it: a call attends -> [T, Hq * D] (what timed_ms times)."""
    dev = s.table.device
    rows = torch.cat([torch.full((n,), r) for r, _, n in tokens])
    pos = torch.cat([torch.arange(p, p + n) for _, p, n in tokens])
    host = (rows.numpy(), pos.numpy())
    rows, pos = rows.to(dev), pos.to(dev)
    slots = s.table[rows, pos].long()
    q = s.q[rows, pos]
    plan = plan_triton(s.table, rows, pos, slots, host=host, **choices)
    settings = LayerAttention(s.q.shape[-1] ** -0.5)
    return lambda: plan.attend(q, s.k, s.v, settings)


def attend(s: KvSetup, tokens: list[tuple[int, int, int]], **choices) -> torch.Tensor:
    return planned(s, tokens, **choices)()


def check_attention(t: Table, device: torch.device, shape: dict, context: int) -> None:
    """Row 0's last token (position context - 1) alone = among 63 decode rows = in prompt
    chunks ending there of three sizes = in a verify of 5 tokens = in 64-row tiles = in
    launches of one token; its float64 distance; previous and new timed."""
    lengths = [context] + [int(x) for x in torch.linspace(1, context, 63)]
    s = kv_setup(device, shape, lengths)
    last = context - 1
    alone = attend(s, [(0, last, 1)])
    decode = [(r, n - 1, 1) for r, n in enumerate(lengths)]
    cases = {
        "among 63 decode rows": attend(s, decode)[:1],
        "64-row decode tiles": attend(s, [(0, last, 1)], decode_block_m=64),
    }
    for chunk in (77, 256, min(1000, context)):
        cases[f"last of a {chunk}-token chunk"] = attend(s, [(0, context - chunk, chunk)])[-1:]
    cases["last of a 5-token verify among decode rows"] = attend(
        s, [(0, context - 5, 5)] + decode[1:]
    )[4:5]
    saved = attention_triton.PARTIAL_BYTES
    attention_triton.PARTIAL_BYTES = 1
    try:
        cases["in launches of one token"] = attend(s, decode)[:1]
    finally:
        attention_triton.PARTIAL_BYTES = saved
    for name, got in cases.items():
        t.check(f"attention: alone = {name}", torch.equal(got, alone))
    ieee = attend(s, [(0, last, 1)], pv_hi_lo=False)
    t.info("attention: hi+lo P.V vs IEEE float32 P.V, max |diff|",
           f"{(ieee.float() - alone.float()).abs().max().item():.2e}")  # fmt: skip
    t.info("attention: max |error| against float64", f"{_attention_error(s, alone, last):.2e}")
    new = timed_ms(planned(s, decode), device)
    old = timed_ms(planned(s, decode, decode_block_m=64, pv_hi_lo=False), device)
    t.info(f"attention 64 rows x ~{context // 2} mean context ms previous->new",
           f"{old:.3f}->{new:.3f}")  # fmt: skip
    prefill = [(0, 0, context)]
    new = timed_ms(planned(s, prefill), device)
    old = timed_ms(planned(s, prefill, pv_hi_lo=False), device)
    t.info(f"attention {context}-token prefill ms previous->new", f"{old:.3f}->{new:.3f}")


def _attention_error(s: KvSetup, got: torch.Tensor, last: int) -> float:
    slots = s.table[0, : last + 1].long()
    group = s.q.shape[2] // s.k.shape[0]
    k = s.k[:, slots].double().repeat_interleave(group, 0)  # [Hq, L, D]
    v = s.v[:, slots].double().repeat_interleave(group, 0)
    q = s.q[0, last].double()  # [Hq, D]
    weights = torch.softmax((k @ q[:, :, None]).squeeze(-1) * q.shape[-1] ** -0.5, -1)
    exact = (weights[:, None, :] @ v).squeeze(1).reshape(1, -1)
    return (got.double() - exact).abs().max().item()


def check_rows(t: Table, device: torch.device, shape: dict) -> None:
    """RMSNorm and the log-softmax's sums: row 0 alone = in 64 and 512 rows, ours and
    torch's (the hole the row-local kernels close)."""
    g = torch.Generator(device=device).manual_seed(2)
    x = 3 * torch.randn(512, shape["hidden"], device=device, generator=g)
    w = (torch.rand(shape["hidden"], device=device, generator=g) + 0.5).to(torch.bfloat16)

    def torch_norm(a: torch.Tensor) -> torch.Tensor:
        return (w.float() * (a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-5))).to(w.dtype)

    def ours(a: torch.Tensor) -> torch.Tensor:
        return rowwise_triton.rms_norm(a, w, 1e-5)

    for name, fn in (("rms_norm", ours), ("torch's rms_norm", torch_norm)):
        alone = fn(x[:1])
        same = all(torch.equal(fn(x[:n])[:1], alone) for n in (2, 64, 512))
        if fn is ours:
            t.check(f"{name}: alone = in 2, 64, 512 rows", same)
        else:
            t.info(f"{name}: alone = in 2, 64, 512 rows", str(same))
    diff = (ours(x).float() - torch_norm(x).float()).abs().max().item()
    t.info("rms_norm against torch's, max |diff|", f"{diff:.2e}")
    logits = 4 * torch.randn(256, shape["vocab"], device=device, generator=g)

    def torch_sums(a: torch.Tensor) -> torch.Tensor:
        return torch.exp(a - a.amax(-1, keepdim=True)).sum(-1, dtype=torch.float64).log().float()

    for name, fn2 in (("log_softmax sums", lambda a: rowwise_triton.log_softmax_stats(a)[1]),
                      ("torch's log_softmax sums", torch_sums)):  # fmt: skip
        alone = fn2(logits[:1])
        same = all(torch.equal(fn2(logits[:n])[:1], alone) for n in (2, 64, 256))
        if name.startswith("torch"):
            t.info(f"{name}: alone = in 2, 64, 256 rows", str(same))
        else:
            t.check(f"{name}: alone = in 2, 64, 256 rows", same)


def stage_kernels(t: Table, device: torch.device, dry: bool) -> None:
    shape = DRY if dry else LLAMA_8B
    rows = (1, 16, 64) if dry else (1, 16, 64, 4096)
    check_rows(t, device, shape)
    check_attention(t, device, shape, 300 if dry else 2048)
    check_linear(t, device, shape, rows)


# -- the model ------------------------------------------------------------------------------


def same_output(a, b) -> bool:
    """Tokens, logprobs and top logprobs, bit for bit."""
    tops = all((x == y).all() for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True)) and len(
        a.top_logprobs
    ) == len(b.top_logprobs)
    return a.output_ids == b.output_ids and a.logprobs == b.logprobs and bool(tops)


def stage_model(t: Table, model: Path, args: argparse.Namespace) -> None:
    """One prompt alone, among 63, under two other chunkings, after a prefix-cache hit."""
    g = torch.Generator().manual_seed(5)
    length = 100 if args.dry_run else 1000
    target = torch.randint(10, 30000 if not args.dry_run else 250, (length,), generator=g)
    others = [torch.randint(10, 250 if args.dry_run else 30000, (length // 2,), generator=g)
              for _ in range(63)]  # fmt: skip
    ask = {"max_tokens": 12, "num_top": 5}
    e = engine(model, args, "triton", load_format="dummy", max_running_requests=64)
    runner = e.runner
    alone = e.generate([OfflineRequest(target.tolist(), **ask)])[0]
    t.info("model: the prompt's first tokens", str(alone.output_ids[:6]))
    cached = e.generate([OfflineRequest(target.tolist(), **ask)])[0]
    t.check("model: alone = after a prefix-cache hit", same_output(cached, alone))
    batch = OfflineEngine(runner, max_prefill_tokens=8192, enable_prefix_cache=False).generate(
        [OfflineRequest(p.tolist(), **ask) for p in others[:31]]
        + [OfflineRequest(target.tolist(), **ask)]
        + [OfflineRequest(p.tolist(), **ask) for p in others[31:]]
    )[31]
    t.check("model: alone = among 63", same_output(batch, alone))
    for chunk in (300, 77):
        e2 = OfflineEngine(runner, max_prefill_tokens=chunk, enable_prefix_cache=False)
        got = e2.generate([OfflineRequest(target.tolist(), **ask)])[0]
        t.check(f"model: alone = in {chunk}-token chunks", same_output(got, alone))


def stage_tiny(t: Table, tiny: Path, args: argparse.Namespace) -> None:
    """The tiny checkpoint on Triton and on SDPA: the same tokens, float32 logprobs within
    1e-4, each request alone = in its batch on Triton (gpu_check.agreement)."""
    for name, value in agreement(tiny, args, ["triton", "sdpa"]).items():
        if isinstance(value, bool) and ("sdpa" in name or "bfloat16 same" in name):
            # NOTE: cuBLAS promises no row invariance, and in bfloat16 a near-tie of the
            # random checkpoint can fall either way between two sets of kernels
            t.info(f"tiny: {name}", str(value))
        elif isinstance(value, bool):
            t.check(f"tiny: {name}", value)
        elif "float32" in name:
            t.check(f"tiny: {name}", value < 1e-4, f"{value:.1e}", "< 1e-4")
        else:
            t.info(f"tiny: {name}", f"{value:.1e}")


def stage_syncs(t: Table, tiny: Path, args: argparse.Namespace) -> None:
    """The host syncs in each decode step of a 4-row batch, two rows greedy and two sampled
    with every filter (torch's sync debug mode warns on each synchronising call); the one
    allowed is the result's copy back (tests/test_step_syncs.py counts the rest on the CPU)."""
    if args.device == "cpu":
        t.info("syncs a decode step", "not counted on the CPU")
        return
    e = engine(tiny, args, "triton", kv_cache_tokens=4096, max_model_len=512)
    inner = e.sockets.step
    counts: list[int] = []

    def step(batch):
        decode = b"\x01" not in batch.is_prefill.data
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                result = inner(batch)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        if decode:
            counts.append(sum("synchroniz" in str(w.message) for w in seen))
        return result

    e.sockets.step = step
    random = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 1}
    e.generate([OfflineRequest(list(range(20, 20 + 9 * i)), max_tokens=8, num_top=5,
                               **(random if i % 2 else {})) for i in range(1, 5)])  # fmt: skip
    median = sorted(counts)[len(counts) // 2]
    t.check("syncs a decode step (median)", median <= 1, str(median), "1")


def stage_speed(t: Table, model: Path, args: argparse.Namespace, bandwidth: float,
                rate: float) -> None:  # fmt: skip
    r = speed(model, args, "triton", bandwidth)
    rows = [int(x) for x in args.rows.split(",")]
    for n in rows:
        value = r[f"{n} rows bound_over_step"]
        step = r[f"{n} rows top0 decode_step_ms"]
        if n == max(rows):
            t.reach(f"decode {n} rows x {args.context}: read-once bound / step", value, 0.7)
        else:
            t.info(f"decode {n} rows x {args.context}: read-once bound / step", f"{value:.3f}")
        t.info(f"decode {n} rows: step ms", f"{step:.2f}")
        cost = r[f"{n} rows top5 out_tok_s"] / r[f"{n} rows top0 out_tok_s"]
        t.reach(f"decode {n} rows: tok/s with top-5 / without", cost, 0.97)
    t.reach(f"prefill {r['prefill_tokens']} tokens / bare product", r["prefill_tflop_s"] * 1e12
            / rate, 0.6)  # fmt: skip
    t.facts["speed"] = r


def stage_kv(t: Table, model: Path, args: argparse.Namespace) -> None:
    if args.device == "cpu":
        t.info("KV sizing", "profiled on a GPU only")
        return
    r = kv_sizing(model, args)
    t.info("KV sizing", r["describe"])
    t.check("KV sizing: 64 rows' peak within the share", r["peak"] <= r["share"],
            f"{r['peak'] / 2**30:.1f} of {r['share'] / 2**30:.1f} GiB", "<= share")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(STAGES), help=f"stages, comma list: {STAGES}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()
    # NOTE: what gpu_check.engine and gpu_check.speed read
    args.dtype = "bfloat16"
    args.rows, args.context, args.prefill, args.steps = "64,16,1", 2048, 4096, 16
    if args.dry_run:
        args.device = "cpu"
        args.rows, args.context, args.prefill, args.steps = "4,1", 64, 128, 4
    return args


def main() -> int:
    args = parse_args()
    if args.dry_run:  # NOTE: the interpreter leaves bfloat16 dots undone without this
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from triton_interpreter import rowwise_interpreted_dot

        rowwise_interpreted_dot()
    stages = args.only.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"--only: unknown stages {sorted(unknown)}; choose from {STAGES}")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    t = Table(args.out)
    work = Path(tempfile.mkdtemp(prefix="gpu-accept-"))
    tiny = build_checkpoint(work / "tiny", "llama", "tiny")
    shaped = shaped_model(tiny, "tiny" if args.dry_run else "8b", work / "shaped")
    bandwidth, rate = stage_env(t, device, args.dry_run)
    runs: dict[str, Callable[[], None]] = {
        "kernels": lambda: stage_kernels(t, device, args.dry_run),
        "tiny": lambda: stage_tiny(t, tiny, args),
        "model": lambda: stage_model(t, shaped, args),
        "syncs": lambda: stage_syncs(t, tiny, args),
        "speed": lambda: stage_speed(t, shaped, args, bandwidth, rate),
        "kv": lambda: stage_kv(t, shaped, args),
    }  # fmt: skip
    for name in STAGES[1:]:
        if name in stages:
            started = time.perf_counter()
            try:
                runs[name]()
            except Exception as error:  # NOTE: one stage's failure must not hide the rest
                t.check(f"stage {name} ran", False, f"{type(error).__name__}: {error}"[:200])
            print(f"stage {name}: {time.perf_counter() - started:.0f} s", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    t.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
