"""Run by tests/test_attention_triton.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported): the Triton paged attention against float64 attention, and a row's
result alone against the same row in a batch, bit for bit."""

from __future__ import annotations

import sys

import torch
from triton_interpreter import rowwise_interpreted_dot

from tokenmill.tp_worker.cuda import attention as attention_triton
from tokenmill.tp_worker.cuda.attention import SPLIT, plan_triton
from tokenmill.tp_worker.model.layer_attention import LayerAttention

HQ, HKV, DIM, SLOTS = 4, 2, 16, 2048  # NOTE: the heads change per run (main): 9 / 3 too


def make_cache(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(HKV, SLOTS, DIM, generator=g).to(dtype)
    v = torch.randn(HKV, SLOTS, DIM, generator=g).to(dtype)
    return k, v


def make_batch(rows: list[tuple[int, int]], width: int, seed: int):
    """rows: (prefix_len, extend_len) per request; each gets its own shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    slots = torch.randperm(SLOTS, generator=g)
    used = 0
    for r, (prefix, extend) in enumerate(rows):
        n = prefix + extend
        table[r, :n] = slots[used : used + n].int()
        used += n
    prefix = torch.tensor([p for p, _ in rows])
    extend = torch.tensor([e for _, e in rows])
    out_slots = torch.cat([table[r, p : p + e].long() for r, (p, e) in enumerate(rows)])
    token_rows = torch.cat([torch.full((e,), r) for r, (_, e) in enumerate(rows)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in rows])
    return table, token_rows, positions, out_slots


def reference(q, k, v, table, rows, settings):
    """float64, token by token."""
    scale, window, cap = settings.scale, settings.window, settings.softcap
    out = []
    t = 0
    for r, (prefix, extend) in enumerate(rows):
        for i in range(extend):
            pos = prefix + i
            first = max(0, pos - window + 1) if window else 0
            slots = table[r, first : pos + 1].long()
            heads = []
            for h in range(HQ):
                kh = k[h // (HQ // HKV), slots].double()
                vh = v[h // (HQ // HKV), slots].double()
                scores = kh @ q[t, h].double() * scale
                if cap:
                    scores = torch.tanh(scores / cap) * cap
                if settings.sinks is not None:  # NOTE: a key of the sink's score, no value
                    scores = torch.cat((scores, settings.sinks[h : h + 1].double()))
                p = torch.softmax(scores, 0)[: len(slots)]
                heads.append(p @ vh)
            out.append(torch.cat(heads))
            t += 1
    return torch.stack(out)


def run(dtype: torch.dtype, window: int, softcap: float = 0.0, sinks: bool = False) -> None:
    rows = [(0, 7), (SPLIT + 40, 1), (3, 1), (2 * SPLIT - 5, 9), (0, 1), (SPLIT - 1, 2)]
    width = 3 * SPLIT
    k, v = make_cache(dtype, 1)
    table, token_rows, positions, out_slots = make_batch(rows, width, 2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(out_slots), HQ, DIM, generator=g).to(dtype)
    # NOTE: gpt-oss's sinks, spread so that some heads' sink outweighs their keys
    sink_logits = torch.linspace(-2.0, 3.0, HQ) if sinks else None
    scale = LayerAttention(DIM**-0.5, window, softcap, sink_logits)
    plan = plan_triton(table, token_rows, positions, out_slots)
    got = plan.attend(q, k, v, scale)
    want = reference(q, k, v, table, rows, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    error = (got.double() - want).abs().max().item()
    assert error < tolerance, (dtype, window, error)
    ieee = plan_triton(table, token_rows, positions, out_slots, pv_hi_lo=False)
    assert (ieee.attend(q, k, v, scale).double() - want).abs().max().item() < tolerance
    # each row alone: bit for bit what it got in the batch
    start = 0
    for r, (_, e) in enumerate(rows):
        mine = slice(start, start + e)
        alone = plan_triton(
            table[r : r + 1], token_rows[mine] - r, positions[mine], out_slots[mine]
        ).attend(q[mine], k, v, scale)  # fmt: skip
        assert torch.equal(alone, got[mine]), (dtype, window, r)
        if e > 2:  # NOTE: the row's tokens as two chunks (another place in their tiles)
            cut = slice(start + 1, start + e)
            later = plan_triton(
                table[r : r + 1], token_rows[cut] - r, positions[cut], out_slots[cut]
            ).attend(q[cut], k, v, scale)  # fmt: skip
            assert torch.equal(later, got[cut]), (dtype, window, r, "chunked")
        start += e
    # NOTE: the free placement: partials in many launches, decode tiles of another height
    saved = attention_triton.PARTIAL_BYTES
    attention_triton.PARTIAL_BYTES = 1
    try:
        split_up = plan_triton(table, token_rows, positions, out_slots)
        group_p = 1 << (HQ // HKV - 1).bit_length()  # NOTE: the GQA group padded, as attend pads it
        assert len(split_up.plan(group_p, HQ * (DIM + 2) * 4).launches) > 1
        assert torch.equal(split_up.attend(q, k, v, scale), got), (dtype, window, "launches")
    finally:
        attention_triton.PARTIAL_BYTES = saved
    decode = [r for r, (_, e) in enumerate(rows) if e == 1]
    index = torch.tensor([sum(e for _, e in rows[:r]) for r in decode])
    for height in (16, 64):
        tall = plan_triton(
            table[decode], torch.arange(len(decode)), positions[index], out_slots[index],
            decode_block_m=height,
        ).attend(q[index], k, v, scale)  # fmt: skip
        assert torch.equal(tall, got[index]), (dtype, window, height)
    heads = f"heads {HQ}/{HKV}"
    print(
        f"{dtype} window={window} softcap={softcap} sinks={sinks} {heads}: "
        f"max |error| {error:.2e}, "
        "rows alone = in the batch"
    )


def run_model(model_dir: str) -> None:
    """The whole model on the Triton backend against the torch path (SDPA): a prompt with
    its logprobs, a prefix-cache hit, greedy tokens."""
    from tokenmill.offline.engine import OfflineEngine, OfflineRequest
    from tokenmill.tp_worker.config import RunnerConfig
    from tokenmill.tp_worker.model_runner import ModelRunner

    results = {}
    for backend in ("sdpa", "triton"):
        config = RunnerConfig(
            model=model_dir, kv_cache_tokens=1024, max_running_requests=4, max_model_len=256,
            dtype="float32", device="cpu", cpu_kernels=False, attention_backend=backend,
        )  # fmt: skip
        engine = OfflineEngine(ModelRunner(config), max_prefill_tokens=64)
        prompt = list(range(20, 60))
        requests = [
            OfflineRequest(prompt, max_tokens=4, num_top=3, prompt_logprob_start=0),
            OfflineRequest(prompt[:30] + [7, 8], max_tokens=4),  # a prefix hit, then decode
        ]
        results[backend] = engine.generate(requests)
    for a, b in zip(results["sdpa"], results["triton"], strict=True):
        assert a.output_ids == b.output_ids
        error = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert error < 1e-4, error
    prompt_error = max(
        abs(x - y)
        for x, y in zip(
            results["sdpa"][0].prompt_logprobs, results["triton"][0].prompt_logprobs, strict=True
        )
    )
    assert prompt_error < 1e-4, prompt_error
    print(f"model on Triton = on SDPA: same tokens, logprobs within {max(error, prompt_error):.1e}")


if __name__ == "__main__":
    rowwise_interpreted_dot()
    for dtype in (torch.float32, torch.bfloat16):
        for window in (0, 100):
            run(dtype, window)
    run(torch.float32, 100, sinks=True)  # NOTE: gpt-oss's sinks, in the splits' merge
    run(torch.bfloat16, 0, sinks=True)
    HQ, HKV = 9, 3  # NOTE: a group padded to a power of two (SmolLM2's heads)
    run(torch.float32, 0)
    run(torch.bfloat16, 100)
    run(torch.float32, 100, softcap=2.0)  # NOTE: Gemma 2's soft-cap, low enough to bite
    if len(sys.argv) > 1:
        run_model(sys.argv[1])
    sys.exit(0)
