"""The CPU attention kernels (csrc/attention.cpp, and attention_amx.cpp on a CPU with AMX)
against a float64 reference, and their invariance: a token's output is bitwise the same
alone, in any batch, chunk or thread count."""

from __future__ import annotations

import pytest
import torch

from tokenmill.tp_worker.cpu.attention import PagedAttention
from tokenmill.tp_worker.model.layer_attention import LayerAttention

HEADS, KV_HEADS, DIM = 8, 2, 64


def _cache(
    num_slots: int, dtype: torch.dtype, seed: int = 0, dim: int = DIM
) -> tuple[torch.Tensor, ...]:
    """Head-major [Hkv, slots, D], as the runner allocates it."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(KV_HEADS, num_slots, dim, generator=gen).to(dtype)
    v = torch.randn(KV_HEADS, num_slots, dim, generator=gen).to(dtype)
    return k, v


def _reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: list[int],
    window: int,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token [Hq, D] attending to the keys in `slots`, in float64 (softcap: each
    score s becomes softcap * tanh(s / softcap), as Gemma 2's; sinks [Hq]: one more key per
    head of that score and no value, as gpt-oss's)."""
    if window:
        slots = slots[-window:]
    keys = k_cache[:, slots].transpose(0, 1).double()  # [L, Hkv, D]
    values = v_cache[:, slots].transpose(0, 1).double()
    keys = keys.repeat_interleave(HEADS // KV_HEADS, 1)  # [L, Hq, D]
    values = values.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if sinks is not None:
        weights = torch.cat((scores, sinks.double()[:, None]), -1).softmax(-1)[:, :-1]
        return torch.einsum("hl,lhd->hd", weights, values)
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


def _run(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    table: torch.Tensor,
    rows: list[int],
    positions: list[int],
    window: int = 0,
    split: bool = False,
    dim: int = DIM,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attend without writing new keys: every token's own key is already in the cache.
    Consecutive tokens of a row form one batch row (a prompt chunk), or each token its own
    (`split`: as decode rows)."""
    segments: list[list[int]] = []  # [table row, first token, tokens, first position]
    for t, (row, pos) in enumerate(zip(rows, positions, strict=True)):
        last = segments[-1] if segments else None
        if not split and last and last[0] == row and last[3] + last[2] == pos:
            last[2] += 1
        else:
            segments.append([row, t, 1, pos])
    columns = torch.tensor(segments, dtype=torch.int64).T.contiguous()
    attention = PagedAttention(
        table=table,
        rows=columns[0].clone(),
        token_starts=columns[1].clone(),
        num_tokens=columns[2].clone(),
        first_pos=columns[3].clone(),
        out_slots=torch.zeros(0, dtype=torch.int64),
    )
    settings = LayerAttention(dim**-0.5, window, softcap, sinks)
    return attention.attend(q, caches[0], caches[1], settings)


# NOTE: gpt-oss's sinks, spread over the scores' range so that some heads' sink dominates
SINKS = torch.linspace(-3.0, 4.0, HEADS)


def _table(lens: list[int], width: int = 300) -> torch.Tensor:
    """Row r holds a shuffled, disjoint set of slots: where keys lie is not where they sort."""
    perm = torch.randperm(len(lens) * width, generator=torch.Generator().manual_seed(1))
    return perm.view(len(lens), width).int()


def _in_runs(
    table: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor]
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The same keys and values moved so that each row's positions lie on consecutive slots:
    (caches, table) for _run."""
    runs = torch.arange(table.numel(), dtype=torch.int32).view(table.shape)
    moved = tuple(c[:, table.flatten().long()].contiguous() for c in caches)
    return (moved[0], moved[1]), runs


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(
    dtype: torch.dtype, window: int, softcap: float, sinks: torch.Tensor | None, cpu_kernel: str
) -> None:
    """softcap: Gemma 2's soft-capped scores, low enough to bite (scores of a few units);
    sinks: gpt-oss's."""
    if cpu_kernel == "amx" and dtype == torch.float32:
        pytest.skip("the AMX kernels take bfloat16")
    lens = [1, 7, 40, 260]
    table = _table(lens)
    caches = _cache(table.numel(), dtype)
    rows = [r for r, n in enumerate(lens) for _ in range(min(n, 9))]
    positions = [p for n in lens for p in range(n - min(n, 9), n)]
    q = torch.randn(len(rows), HEADS, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = _run(q, caches, table, rows, positions, window, softcap=softcap, sinks=sinks)
    out = out.view(len(rows), HEADS, DIM)
    # NOTE: in bfloat16 the output's own rounding is up to 2^-9 of it (0.0156 at 4 and more,
    # which an output of a window of 5 keys can reach): a relative part on top of the kernel's.
    atol, rtol = (2e-6, 0.0) if dtype == torch.float32 else (1e-2, 2**-8)
    for i, (row, pos) in enumerate(zip(rows, positions, strict=True)):
        slots = table[row, : pos + 1].tolist()
        expected = _reference(
            q[i].float(), caches[0], caches[1], slots, window, DIM**-0.5, softcap, sinks
        )
        torch.testing.assert_close(out[i].double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("cap", "sinks"), [(2.0, None), (0.0, SINKS)], ids=["softcap", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_and_sinks_have_their_bits_on_every_path(
    dtype: torch.dtype, cap: float, sinks: torch.Tensor | None, cpu_kernel: str
) -> None:
    """Gemma 2's soft-cap (here 2, low enough to bite), or gpt-oss's sinks, on heads of 128:
    prompt chunks and decode rows, slots scattered or in runs, and a decode row past 3,072
    keys (its heads shared among the threads), the same bits; close to float64."""
    if cpu_kernel == "amx" and dtype == torch.float32:
        pytest.skip("the AMX kernels take bfloat16")
    dim, lens = 128, [1, 40, 3100]
    table = _table(lens, width=3100)
    caches = _cache(table.numel(), dtype, dim=dim)
    rows = [r for r, n in enumerate(lens) for _ in range(min(n, 40))]
    positions = [p for n in lens for p in range(n - min(n, 40), n)]
    gen = torch.Generator().manual_seed(6)
    # NOTE: scores large enough for the cap to bite; without it, of the scale where float32
    # keeps 2e-6 of float64 over 3,100 keys
    q = ((3 if cap else 1) * torch.randn(len(rows), HEADS, dim, generator=gen)).to(dtype)
    kinds = {"dim": dim, "softcap": cap, "sinks": sinks}
    together = _run(q, caches, table, rows, positions, **kinds)
    split = _run(q, caches, table, rows, positions, split=True, **kinds)
    assert torch.equal(split, together)
    in_runs, runs = _in_runs(table, caches)
    assert torch.equal(_run(q, in_runs, runs, rows, positions, **kinds), together)
    last = len(rows) - 1
    alone = _run(q[last:], caches, table, rows[last:], positions[last:], **kinds)
    assert torch.equal(alone[0], together[last])
    out = together.view(len(rows), HEADS, dim)
    atol, rtol = (2e-6, 0.0) if dtype == torch.float32 else (1e-2, 2**-8)
    for i in (0, 1, 40, last):
        slots = table[rows[i], : positions[i] + 1].tolist()
        expected = _reference(q[i].float(), caches[0], caches[1], slots, 0, dim**-0.5, cap, sinks)
        torch.testing.assert_close(out[i].double(), expected, atol=atol, rtol=rtol)


def test_bfloat16_is_no_further_from_float64_than_torch_bfloat16(cpu_kernel: str) -> None:
    """Token by token against float64 attention, the bfloat16 kernel's mean error is within 1%
    of that of torch's bfloat16 scaled_dot_product_attention (what transformers runs on the
    CPU) on the same inputs."""
    lens = [40, 260]
    table = _table(lens)
    k_cache, v_cache = _cache(table.numel(), torch.bfloat16)
    rows = [r for r, n in enumerate(lens) for _ in range(n)]
    positions = [p for n in lens for p in range(n)]
    q = (
        2 * torch.randn(len(rows), HEADS, DIM, generator=torch.Generator().manual_seed(2))
    ).bfloat16()  # peaked scores, as a model's
    ours = _run(q, (k_cache, v_cache), table, rows, positions).view(len(rows), HEADS, DIM)
    our_err, torch_err = [], []
    for i, (row, pos) in enumerate(zip(rows, positions, strict=True)):
        slots = table[row, : pos + 1].tolist()
        exact = _reference(q[i], k_cache, v_cache, slots, 0, DIM**-0.5)
        keys, values = (
            c[:, slots].repeat_interleave(HEADS // KV_HEADS, 0) for c in (k_cache, v_cache)
        )
        theirs = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1), keys, values, scale=DIM**-0.5
        ).squeeze(1)
        our_err.append((ours[i].double() - exact).abs().mean().item())
        torch_err.append((theirs.double() - exact).abs().mean().item())
    mean_ours, mean_torch = sum(our_err) / len(rows), sum(torch_err) / len(rows)
    # NOTE: both are dominated by the output's own rounding to bfloat16 (their means agree to
    # ~0.1%); one bfloat16 weight per key instead of two parts was 20% further (5.0e-4).
    assert mean_ours <= 1.01 * mean_torch, f"ours {mean_ours:.4e}, torch {mean_torch:.4e}"


def test_heads_of_128_match_float64_and_are_the_same_in_a_chunk_and_alone(cpu_kernel: str) -> None:
    """bfloat16 heads of 128 columns (on AVX-512 the prompt path scores them 16 keys at a
    time, a kernel of its own per head size): against float64, and the same bits as prompt
    chunks and as decode rows."""
    dim, lens = 128, [1, 40, 260]
    table = _table(lens)
    caches = _cache(table.numel(), torch.bfloat16, dim=dim)
    rows = [r for r, n in enumerate(lens) for _ in range(n)]
    positions = [p for n in lens for p in range(n)]
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(rows), HEADS, dim, generator=gen).bfloat16()
    together = _run(q, caches, table, rows, positions, dim=dim)
    assert torch.equal(_run(q, caches, table, rows, positions, split=True, dim=dim), together)
    in_runs, runs = _in_runs(table, caches)
    assert torch.equal(_run(q, in_runs, runs, rows, positions, dim=dim), together)
    out = together.view(len(rows), HEADS, dim)
    for i in (0, 1, 40, 41, 100, len(rows) - 1):
        slots = table[rows[i], : positions[i] + 1].tolist()
        expected = _reference(q[i].float(), caches[0], caches[1], slots, 0, dim**-0.5)
        torch.testing.assert_close(out[i].double(), expected, atol=1e-2, rtol=2**-8)


@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_decode_row_has_its_bits_alone_in_a_batch_and_in_a_chunk(
    dtype: torch.dtype, kv_heads: int, cpu_kernel: str
) -> None:
    """A decode row at a long context, of a model whose KV heads do not divide among two
    threads (SmolLM2 has three): past 3,072 keys both kernels share the heads left over
    among the threads (attend_shared in attention.cpp and attention_amx.cpp). Alone (shared),
    among other decode rows (whole heads to each thread) and as the last token of a prompt
    chunk, the same bits, slots scattered or in runs, and close to float64."""
    if cpu_kernel == "amx" and dtype == torch.float32:
        pytest.skip("the AMX kernels take bfloat16")
    heads, dim, lens = 3 * kv_heads, 64, [3100, 700, 3099, 257]
    table = _table(lens, width=3100)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(kv_heads, table.numel(), dim, generator=gen).to(dtype) for _ in "kv")
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    positions = [n - 1 for n in lens]
    batch = _run(q, (k, v), table, list(range(len(lens))), positions, split=True)
    for r in range(len(lens)):
        alone = _run(q[r : r + 1], (k, v), table, [r], positions[r : r + 1])
        assert torch.equal(alone[0], batch[r]), f"row {r}"
    chunk_q = torch.cat([torch.randn(9, heads, dim, generator=gen).to(dtype), q[:1]])
    chunk = _run(chunk_q, (k, v), table, [0] * 10, list(range(lens[0] - 10, lens[0])))
    assert torch.equal(chunk[-1], batch[0])
    in_runs, runs = _in_runs(table, (k, v))
    assert torch.equal(_run(q[:1], in_runs, runs, [0], positions[:1])[0], batch[0])
    keys = k[:, table[0].long()].double().repeat_interleave(3, 0)  # [heads, 3100, dim]
    values = v[:, table[0].long()].double().repeat_interleave(3, 0)
    weights = (torch.einsum("hd,hld->hl", q[0].double(), keys[:, : lens[0]]) / 8).softmax(-1)
    expected = torch.einsum("hl,hld->hd", weights, values[:, : lens[0]])
    torch.testing.assert_close(batch[0].view(heads, dim).double(), expected, atol=1e-2, rtol=2**-8)


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_is_bitwise_the_same_in_any_company(
    dtype: torch.dtype, window: int, cpu_kernel: str
) -> None:
    """Whole prompts, each token as its own (decode) row, alone, and in other chunkings."""
    if cpu_kernel == "amx" and dtype == torch.float32:
        pytest.skip("the AMX kernels take bfloat16")
    lens = [300, 3, 150, 77, 299, 12]
    table = _table(lens)
    caches = _cache(table.numel(), dtype)
    rows = [r for r, n in enumerate(lens) for _ in range(n)]
    positions = [p for n in lens for p in range(n)]
    q = torch.randn(len(rows), HEADS, DIM).to(dtype)
    together = _run(q, caches, table, rows, positions, window)
    assert torch.equal(_run(q, caches, table, rows, positions, window, split=True), together)
    for cut in (1, 2, 3, 5, 7):  # the first row's prompt in chunks that start at `cut`
        sub = slice(cut, 300)
        part = _run(q[sub], caches, table, rows[sub], positions[sub], window)
        assert torch.equal(part, together[sub])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = _run(q, caches, table, rows, positions, window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, single_thread)
    for i in (0, 299, 300, 400, len(rows) - 1):
        alone = _run(q[i : i + 1], caches, table, rows[i : i + 1], positions[i : i + 1], window)
        assert torch.equal(alone[0], together[i])
    # The kernel follows the cache's strides: slot-major memory viewed as [Hkv, slots, D].
    slot_major = tuple(c.transpose(0, 1).contiguous().transpose(0, 1) for c in caches)
    assert slot_major[0].stride() != caches[0].stride()
    assert torch.equal(_run(q, slot_major, table, rows, positions, window), together)
    # Where the keys lie changes no bit: the same keys on consecutive slots, as the slot pool
    # hands out a row's positions (the prompt path reads such blocks in place, not copied).
    assert torch.equal(_run(q, *_in_runs(table, caches), rows, positions, window), together)
