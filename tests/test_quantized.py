"""GGUF's quantized weights multiplied in their blocks (cpu/quantized.py, csrc/dequant.h,
csrc/quant_exact.h, csrc/quant_kernels.h): for every served type, float32 has every bit of
the packed product of the weight the `gguf` package dequantizes, at one row (the fused
microkernels) and at many (a panel dequantized into a buffer), with a bias, a residual and the
gate/up epilogue; bfloat16 sums gguf's weights unrounded, within a stated bound of a float64
product, with each row's bits the same alone and in any batch; an embedding's rows are gguf's
values; the build without any AVX gives the same bits. End to end, a Q4_K_M-like file served
from its blocks gives the same bits alone, in a batch, chunked and decoded several steps at a
time, and in float32 the bits of its dequantized weights (the numbers against transformers on
a file: test_gguf.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as dequantize_file_tensor_data
from gguf_files import edited, encode, hf_to_gguf
from helpers import make_engine

from tokenmill.cli.gguf_checkpoint import gguf_checkpoint
from tokenmill.offline.engine import OfflineOutput, OfflineRequest
from tokenmill.tp_worker.cpu import kernels as cpu_kernels
from tokenmill.tp_worker.cpu import quantized
from tokenmill.tp_worker.cpu.ops import PackedLinear
from tokenmill.tp_worker.cpu.quantized import (
    LAYOUTS,
    TYPE_NAMES,
    QuantLinear,
    QuantRows,
    dequantize,
)

TYPES = sorted(LAYOUTS)
DTYPES = (torch.float32, torch.bfloat16)


def random_rows(qtype: int, rows: int, width: int, seed: int = 0) -> QuantRows:
    """Blocks of random bytes with float16 scales of a usual size (random scale bytes could
    be infinities): every bit pattern of q, sc and m occurs."""
    rng = np.random.default_rng(seed * 100 + qtype)
    layout = LAYOUTS[qtype]
    blocks = width // layout.block_k
    raw = rng.integers(0, 256, size=(rows, blocks, layout.file_bytes), dtype=np.uint8)

    def halves(scale: float) -> np.ndarray:
        values = rng.uniform(0.5, 2.0, size=(rows, blocks)) * scale
        return values.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)

    at = layout.file_bytes - 2 if qtype == quantized.Q6_K else 0  # NOTE: Q6_K's d comes last
    raw[..., at : at + 2] = halves(2.0**-8)
    if layout.mins:
        raw[..., 2:4] = halves(2.0**-9)
    return QuantRows(qtype, torch.from_numpy(raw.reshape(rows, -1)), width)


def _assert_rows_alone(product, x: torch.Tensor, **kwargs) -> None:  # noqa: ANN001
    """Each row's bits alone and in every slice are those of the whole batch."""
    whole = product(x, **kwargs)
    for m in (1, 2, 3, 5, 8, 9, 13):
        for i in range(0, len(x) - m + 1, 7):
            part = {k: v[i : i + m] for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            rest = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
            assert torch.equal(product(x[i : i + m], **part, **rest), whole[i : i + m]), (i, m)


@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
def test_float32_is_the_packed_product_of_ggufs_dequantized_weight(qtype: int) -> None:
    rows = random_rows(qtype, 80, 512)  # NOTE: 2.5 panels: a padded last panel
    weight = dequantize(rows)
    bias = torch.randn(80)
    quant = QuantLinear([rows], torch.float32, bias=bias)
    packed = PackedLinear(weight, bias)
    torch.manual_seed(qtype)
    for m in (1, 2, 3, 4, 5, 13, 40):  # NOTE: in registers up to 4 rows, a buffer past them
        x = torch.randn(m, 512)
        assert torch.equal(quant(x), packed(x)), m
        residual = torch.randn(m, 80)
        assert torch.equal(quant(x, residual=residual), packed(x, residual=residual)), m
        assert torch.equal(quant.float_sums(x), packed.float_sums(x)), m
    ids = torch.tensor([0, 7, 31, 32, 79])
    assert torch.equal(quant.rows(ids), weight[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
def test_bfloat16_sums_ggufs_weight_in_one_order_whatever_the_rows(qtype: int) -> None:
    rows = random_rows(qtype, 80, 512)
    weight = dequantize(rows)
    bias = torch.randn(80)
    quant = QuantLinear([rows], torch.bfloat16, bias=bias)
    torch.manual_seed(qtype)
    x = torch.randn(40, 512).to(torch.bfloat16)
    exact = x.double() @ weight.double().T + bias.double()
    error = (quant(x, torch.float32).double() - exact).abs().max() / exact.abs().max()
    assert error < 2e-6, error  # NOTE: float32 sums of gguf's weights (1e-7..1.3e-6 seen)
    _assert_rows_alone(quant, x)
    _assert_rows_alone(quant, x, out_dtype=torch.float32, residual=torch.randn(40, 80))
    _assert_rows_alone(quant.float_sums, x)
    ids = torch.tensor([0, 7, 31, 32, 79])
    assert torch.equal(quant.rows(ids), weight[ids])


def test_the_gate_up_epilogue_and_segments_of_two_types() -> None:
    gate = random_rows(quantized.Q4_K, 64, 256, seed=1)
    up = random_rows(quantized.Q4_K, 64, 256, seed=2)
    # NOTE: q/k/v of a Q4_K_M file: two types in one product, each panel its own type's
    v = random_rows(quantized.Q6_K, 32, 256, seed=3)
    weight = torch.cat([dequantize(gate), dequantize(up)])
    packed = PackedLinear(weight, None, glu=True, activation="silu")
    mixed_packed = PackedLinear(torch.cat([dequantize(gate), dequantize(v)]), None)
    glu = {d: QuantLinear([gate, up], d, glu=True, activation="silu") for d in DTYPES}
    mixed = {d: QuantLinear([gate, v], d) for d in DTYPES}
    for m in (1, 4, 9):
        x = torch.randn(m, 256)
        assert torch.equal(glu[torch.float32](x), packed(x)), m
        assert torch.equal(glu[torch.float32].float_sums(x), packed.float_sums(x)), m
        assert torch.equal(mixed[torch.float32](x), mixed_packed(x)), m
    alone = [QuantLinear([gate], torch.bfloat16), QuantLinear([v], torch.bfloat16)]
    x = torch.randn(20, 256).to(torch.bfloat16)
    g, u = (x.double() @ dequantize(w).double().T for w in (gate, up))
    exact = torch.nn.functional.silu(g) * u
    error = (glu[torch.bfloat16](x, torch.float32).double() - exact).abs().max()
    assert error / exact.abs().max() < 1e-5, error
    _assert_rows_alone(glu[torch.bfloat16], x)
    assert torch.equal(mixed[torch.bfloat16](x), torch.cat([p(x) for p in alone], dim=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_portable_build_gives_the_same_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    products = {t: QuantLinear([random_rows(t, 32, 256)], dtype) for t in TYPES}
    xs = [torch.randn(m, 256).to(dtype) for m in (1, 3, 7)]
    native = {t: [q(x) for x in xs] for t, q in products.items()}
    ids = torch.tensor([0, 17, 31])
    rows = {t: q.rows(ids) for t, q in products.items()}
    portable = cpu_kernels.load(cpu_kernels.build("x86-64-v2"))
    monkeypatch.setattr(quantized, "library", lambda: portable)
    for t, q in products.items():
        for x, expected in zip(xs, native[t], strict=True):
            assert torch.equal(q(x), expected), (TYPE_NAMES[t], x.shape)
        assert torch.equal(q.rows(ids), rows[t]), TYPE_NAMES[t]


def test_a_row_split_off_its_blocks_is_refused() -> None:
    rows = random_rows(quantized.Q4_K, 32, 512)
    assert rows.columns(256, 512).width == 256
    with pytest.raises(ValueError, match="multiples of 256"):
        rows.columns(128, 512)


@pytest.fixture(scope="module")
def q4_k_file(wide_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wide llama as Q4_K (llama.cpp's usual matrices) with its embeddings in Q6_K and
    its v rows in Q8_0 (a q/k/v product of segments of two types)."""
    folder = tmp_path_factory.mktemp("q4k")
    q4_k = hf_to_gguf(wide_checkpoint, folder / "wide-Q4_K.gguf", GGMLQuantizationType.Q4_K)
    rng = np.random.default_rng(0)
    replaced = {}
    for tensor in gguf.GGUFReader(q4_k).tensors:
        kind = {"token_embd": GGMLQuantizationType.Q6_K, "attn_v": GGMLQuantizationType.Q8_0}
        part = next((k for k in kind if k in tensor.name), None)
        if part is not None:
            values = dequantize_file_tensor(tensor)
            replaced[tensor.name] = encode(values, kind[part], rng)
    return edited(q4_k, folder / "wide-Q4_K_M.gguf", tensors=replaced)


def dequantize_file_tensor(tensor) -> np.ndarray:  # noqa: ANN001 (a gguf ReaderTensor)
    return np.asarray(dequantize_file_tensor_data(tensor.data, tensor.tensor_type))


def _requests() -> list[OfflineRequest]:
    rng = np.random.default_rng(0)
    return [
        OfflineRequest(
            rng.integers(3, 500, n).tolist(),
            max_tokens=8,
            num_top=5,
            prompt_logprob_start=n // 3,
            temperature=0.8,
            top_p=0.9,
            seed=i,
        )
        for i, n in enumerate([3, 19, 40, 7, 66])
    ]


def _same(a: OfflineOutput, b: OfflineOutput) -> None:
    assert a.output_ids == b.output_ids
    for field in ("logprobs", "top_ids", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), field)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_file_served_in_blocks_has_the_same_bits_in_every_schedule(
    q4_k_file: Path, dtype: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    model = gguf_checkpoint(q4_k_file)
    requests = _requests()
    served = make_engine(model, dtype=dtype)
    runner = served.runner
    kernels = [m.kernel for m in runner.model.modules() if hasattr(m, "kernel")]
    assert kernels and all(isinstance(k, QuantLinear) for k in kernels)
    assert isinstance(runner.model.lm_head_kernel, QuantLinear)
    qkv = runner.model.layers[0].qkv_proj.kernel
    assert qkv.qtypes == [quantized.Q4_K, quantized.Q4_K, quantized.Q8_0]
    batched = served.generate(requests)
    for request, together in zip(requests, batched, strict=True):
        _same(served.generate([request])[0], together)
    chunked = make_engine(model, dtype=dtype, max_prefill_tokens=16, decode_steps=3)
    for a, b in zip(chunked.generate(requests), batched, strict=True):
        _same(a, b)
    monkeypatch.setenv("TOKENMILL_CPU_GGUF_BLOCKS", "0")
    dense = make_engine(model, dtype=dtype)
    layers = dense.runner.model.modules()
    assert not any(isinstance(getattr(m, "kernel", None), QuantLinear) for m in layers)
    for a, b in zip(dense.generate(requests), batched, strict=True):
        if dtype == "float32":  # NOTE: quant_exact.h: the dense product's bits
            _same(a, b)
        else:  # NOTE: the dense weights rounded to bfloat16 (2^-8 of each), these not
            np.testing.assert_allclose(a.prompt_logprobs, b.prompt_logprobs, rtol=2**-8, atol=0.03)


def test_tensor_parallel_2_keeps_each_ranks_share_in_blocks(
    wide_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At TP 2 each rank keeps its rows of q/k/v and gate/up and its columns of o and down
    (whole Q8_0 blocks) as blocks, the server's log says so, and prompt and greedy logprobs
    are transformers' on the file (float32)."""
    from helpers import oracle
    from server_process import generate_once

    from tokenmill.cli.gguf_checkpoint import transformers_model

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    file = hf_to_gguf(wide_checkpoint, tmp_path / "wide-Q8_0.gguf", GGMLQuantizationType.Q8_0)
    prompt = list(range(90, 140))
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }
    log = tmp_path / "server.log"
    answer = generate_once(file, log, body, "--tensor-parallel-size", "2", "--max-model-len", "512")
    assert log.read_text().count(" products in GGUF blocks (Q8_0 ") == 2  # NOTE: a rank each
    hf = transformers_model(gguf_checkpoint(file), torch.float32)
    ids = prompt + answer["output_ids"]
    ref = oracle(hf, ids)
    meta = answer["meta_info"]
    ours = [e[0] for e in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    np.testing.assert_allclose(ours, ref.of(np.arange(len(ids) - 1), ids[1:]), atol=1e-4, rtol=0)
    assert answer["output_ids"] == ref.logprobs[len(prompt) - 1 :].argmax(-1).tolist()
