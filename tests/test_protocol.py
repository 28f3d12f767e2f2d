"""Round-trip tests for the controller<->worker messages and the array codec in protocol/.

Every array crosses a socket as dtype + shape + raw bytes; these tests pin that a message
decodes to exactly what was encoded, that malformed frames are refused, and that no pickle
path exists anywhere in the package.
"""

from __future__ import annotations

import gc
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tokenmill.protocol.arrays import (
    Array,
    empty,
    pack,
    pack_each,
    pack_list,
    unpack,
    unpack_list,
)
from tokenmill.protocol.cluster import NodeBeat, NodeDown, NodeHello, NodeMessage
from tokenmill.protocol.outputs import (
    BatchOutput,
    DetokenizedBatch,
    DetokenizedOutput,
    PositionLogprobs,
    PromptLogprobs,
    RequestOutput,
    TokenEntry,
)
from tokenmill.protocol.requests import (
    Constraint,
    DetokenizeParams,
    FrontendMessage,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.step import (
    BatchMessage,
    ForwardBatch,
    GrammarMask,
    GrammarRows,
    LogprobAsks,
    SamplingBatch,
    StepResult,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
)

ALLOWED_DTYPES = ["bool", "int8", "int32", "int64", "float16", "float32", "float64", "uint8"]
SHAPES = [(), (0,), (5,), (3, 0), (2, 3), (2, 3, 4), (1, 1, 1, 7)]
PACKAGE_DIRS = ["cli", "controller", "tp_worker", "detokenizer", "frontend", "offline", "protocol"]
REPO_ROOT = Path(__file__).resolve().parent.parent
STEP_DECODER = msgspec.msgpack.Decoder(ForwardBatch | StepResult)
WORKER_DECODER = msgspec.msgpack.Decoder(WorkerMessage)


def _random_array(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if dtype == "bool":
        values = rng.integers(0, 2, size=shape).astype(bool)
    elif np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    else:
        values = rng.standard_normal(size=shape).astype(dtype)
    return np.asarray(values, dtype=dtype)


def _assert_same(decoded: np.ndarray, original: np.ndarray) -> None:
    assert decoded.dtype == original.dtype
    assert decoded.shape == original.shape
    np.testing.assert_array_equal(decoded, original)


@pytest.mark.parametrize("dtype", ALLOWED_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_array_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    original = _random_array(dtype, shape, np.random.default_rng(0))
    message = pack(original)
    assert message.dtype == dtype and message.shape == shape
    _assert_same(unpack(message), original)
    wire = msgspec.msgpack.encode(message)
    _assert_same(unpack(msgspec.msgpack.decode(wire, type=Array)), original)


def test_pack_makes_non_contiguous_arrays_contiguous() -> None:
    original = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2].T
    _assert_same(unpack(pack(original)), original)


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["int32", ">f4", "float32", "bool"])
def test_pack_each_packs_every_slice_as_pack_does(axis: int, dtype: str) -> None:
    array = (np.arange(2 * 3 * 4) % 5).astype(dtype).reshape(2, 3, 4)
    packed = pack_each(array, axis)
    assert packed == [pack(array.take(i, axis)) for i in range(array.shape[axis])]
    assert all(unpack(p).dtype.byteorder in "<=|" for p in packed)


@pytest.mark.parametrize(
    ("dtype", "values"),
    [
        ("int32", [0, -1, 2**31 - 1, -(2**31), True]),
        ("int64", [2**40, -3, 0]),
        ("float32", [0.7, 1e-40, -0.0, 3e38, 1e300, float("inf"), float("nan"), 5]),
        ("float64", [0.1, -2.5]),
        ("bool", [True, False, 1, 0]),
        ("int8", [-128, 127]),  # NOTE: through numpy (no width check for it)
        ("int32", []),
    ],
)
def test_pack_list_packs_what_pack_of_the_numpy_array_packs(dtype: str, values: list) -> None:
    with np.errstate(over="ignore"):  # 1e300 into float32: inf either way
        want = pack(np.asarray(values, dtype=dtype))
    assert pack_list(values, dtype) == want
    assert pack_list(iter(values), dtype) == want
    if len(values) % 2 == 0 and values:
        shaped = pack_list(values, dtype, (2, len(values) // 2))
        assert shaped.shape == (2, len(values) // 2) and shaped.data == want.data


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1])
def test_pack_list_refuses_what_numpy_refuses(value: int) -> None:
    with pytest.raises(OverflowError):
        np.asarray([value], dtype=np.int32)
    with pytest.raises(OverflowError):
        pack_list([value], "int32")
    with pytest.raises(ValueError, match="do not fill"):
        pack_list([1, 2, 3], "int32", (2, 2))


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (0, 5), (1, 5), (2, 1, 3)])
@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "uint8", "int32", "int64", "float16", "float32", "float64"]
)
def test_unpack_list_reads_what_unpack_tolist_reads(shape: tuple[int, ...], dtype: str) -> None:
    values = np.array([-np.inf, np.nan, -0.0, 1.5, -7.25, 1e-40, 3e38, 2.0])
    with np.errstate(invalid="ignore", over="ignore"):  # nan and inf into integers
        array = np.resize(values, shape).astype(dtype)
    got, want = unpack_list(pack(array)), unpack(pack(array)).tolist()
    assert repr(got) == repr(want)  # the same Python types and values, nan and -0.0 too


def test_unpack_list_refuses_a_short_buffer() -> None:
    short = Array("float32", (2, 3), b"\0" * 20)
    with pytest.raises(ValueError):
        unpack_list(short)


def test_zero_dim_array_keeps_its_shape() -> None:
    assert pack(np.array(3.5, np.float32)).shape == ()
    _assert_same(unpack(pack(np.array(3.5, np.float32))), np.array(3.5, np.float32))


@pytest.mark.parametrize("dtype", [">i4", ">f4", ">i8"])
def test_big_endian_arrays_travel_as_little_endian(dtype: str) -> None:
    original = np.arange(-3, 3).astype(dtype)
    np.testing.assert_array_equal(unpack(pack(original)), original)


def test_unpack_is_a_read_only_view() -> None:
    decoded = unpack(pack(np.arange(4, dtype=np.int64)))
    with pytest.raises(ValueError):
        decoded[0] = 1


def test_empty_helper() -> None:
    _assert_same(unpack(empty("float32", 0, 3)), np.zeros((0, 3), np.float32))


@pytest.mark.parametrize("extra_bytes", [-1, 1, 4])
def test_frame_that_does_not_fill_shape_is_rejected(extra_bytes: int) -> None:
    good = pack(np.arange(6, dtype=np.int32).reshape(2, 3))
    data = good.data[:extra_bytes] if extra_bytes < 0 else good.data + b"\0" * extra_bytes
    with pytest.raises(ValueError):
        unpack(Array(good.dtype, good.shape, data))


def test_frame_with_wrong_shape_from_the_wire_is_rejected() -> None:
    wire = msgspec.msgpack.encode(Array("float32", (4, 4), b"\0" * 12))
    with pytest.raises(ValueError):
        unpack(msgspec.msgpack.decode(wire, type=Array))


@pytest.mark.parametrize("dtype", ["object", "complex64"])
def test_disallowed_dtype_is_rejected_both_ways(dtype: str) -> None:
    values = np.array([1, "x"], dtype=object) if dtype == "object" else np.ones(2, dtype)
    with pytest.raises(TypeError):
        pack(values)
    with pytest.raises(ValueError):
        unpack(Array(dtype, (2,), b"\0" * 16))


def _i32(*values: int) -> Array:
    return pack(np.array(values, dtype=np.int32))


def _forward_batch(decode_slots: Array | None, num_steps: int) -> ForwardBatch:
    rng = np.random.default_rng(1)
    return ForwardBatch(
        step_id=7,
        input_ids=pack(rng.integers(0, 32000, size=9, dtype=np.int32)),
        out_slots=pack(np.arange(100, 109, dtype=np.int32)),
        req_rows=_i32(0, 3),
        prefix_lens=_i32(0, 12),
        extend_lens=_i32(8, 1),
        is_prefill=pack(np.array([True, False])),
        fill_rows=_i32(3),
        fill_lens=_i32(12),
        fill_slots=pack(np.arange(12, dtype=np.int32)),
        sampling=SamplingBatch(
            temperature=pack(np.array([0.0, 0.7], np.float32)),
            top_k=_i32(0, 40),
            top_p=pack(np.array([1.0, 0.9], np.float32)),
            min_p=pack(np.array([0.0, 0.05], np.float32)),
            seed=pack(np.array([2**40 + 3, -1], np.int64)),
        ),
        logprobs=LogprobAsks(
            num_top=_i32(5, 0),
            token_ids_offsets=_i32(0, 2, 3),
            token_ids=_i32(11, 12, 13),
            prompt_start=_i32(0, -1),
            prompt_next_id=_i32(42, -1),
        ),
        num_steps=num_steps,
        decode_slots=decode_slots,
    )


def _step_result() -> StepResult:
    rng = np.random.default_rng(2)
    n, b, r, k, m, p, kp = 3, 2, 1, 5, 3, 7, 4
    return StepResult(
        step_id=7,
        next_ids=pack(rng.integers(0, 32000, size=(n, b), dtype=np.int32)),
        logprobs=pack(-rng.random((n, b), dtype=np.float32)),
        top_ids=pack(rng.integers(0, 32000, size=(n, r, k), dtype=np.int32)),
        top_logprobs=pack(-rng.random((n, r, k), dtype=np.float32)),
        token_ids_logprobs=pack(-rng.random((n, m), dtype=np.float32)),
        prompt_offsets=_i32(0, p, p),
        prompt_logprobs=pack(-rng.random(p, dtype=np.float32)),
        prompt_top_ids=pack(rng.integers(0, 32000, size=(p, kp), dtype=np.int32)),
        prompt_top_logprobs=pack(-rng.random((p, kp), dtype=np.float32)),
    )


def _assert_struct_equal(decoded: msgspec.Struct, original: msgspec.Struct) -> None:
    """Field by field; arrays compared by dtype, shape and values after unpacking."""
    assert type(decoded) is type(original)
    for name in original.__struct_fields__:
        got, want = getattr(decoded, name), getattr(original, name)
        if isinstance(want, Array):
            assert isinstance(got, Array), name
            _assert_same(unpack(got), unpack(want))
        elif isinstance(want, msgspec.Struct):
            _assert_struct_equal(got, want)
        else:
            assert got == want, name


@pytest.mark.parametrize(
    "message",
    [
        _forward_batch(None, 1),
        _forward_batch(pack(np.array([[109, 200], [110, 201]], np.int32)), 3),
        _step_result(),
    ],
    ids=["forward", "forward_multi_step", "step_result"],
)
def test_step_messages_round_trip_through_tagged_union(message: msgspec.Struct) -> None:
    decoded = STEP_DECODER.decode(msgspec.msgpack.encode(message))
    _assert_struct_equal(decoded, message)
    assert decoded == message


@pytest.mark.parametrize(
    "message",
    [WorkerReady(8256, 8192, (1, 128001)), _step_result(), WorkerFailed(9, "CUDA OOM")],
    ids=["ready", "step", "failed"],
)
def test_worker_messages_round_trip(message: msgspec.Struct) -> None:
    decoded = WORKER_DECODER.decode(msgspec.msgpack.encode(message))
    _assert_struct_equal(decoded, message)


def test_constrained_batches_and_their_masks_round_trip() -> None:
    """A constrained batch (masks inline or following) and its GrammarMask, on the decoder
    a worker reads its step channel with; a request's constraint on the frontend's."""
    masks = pack(np.array([[-1, 5], [0, 7]], np.int32))
    decoder = msgspec.msgpack.Decoder(BatchMessage)
    plain = _forward_batch(None, 1)
    for bitmask in (None, masks):
        grammar = GrammarRows(rows=_i32(0, 1), bitmask=bitmask)
        sampling = msgspec.structs.replace(plain.sampling, grammar=grammar)
        batch = msgspec.structs.replace(plain, sampling=sampling)
        decoded = decoder.decode(msgspec.msgpack.encode(batch))
        _assert_struct_equal(decoded, batch)
    follow = GrammarMask(step_id=7, bitmask=masks)
    _assert_struct_equal(decoder.decode(msgspec.msgpack.encode(follow)), follow)
    request = GenerateRequest(
        "r",
        _i32(1, 2),
        SamplingParams(max_tokens=3),
        LogprobParams(),
        DetokenizeParams(),
        constraint=Constraint("regex", '{"grammars": []}'),
    )
    decoded = msgspec.msgpack.Decoder(FrontendMessage).decode(msgspec.msgpack.encode(request))
    assert decoded == request


def test_forward_batch_defaults_survive_the_wire() -> None:
    decoded = STEP_DECODER.decode(msgspec.msgpack.encode(_forward_batch(None, 1)))
    assert isinstance(decoded, ForwardBatch)
    assert decoded.num_steps == 1 and decoded.decode_slots is None


def test_step_decoder_rejects_untagged_and_foreign_bytes() -> None:
    with pytest.raises(msgspec.ValidationError):
        STEP_DECODER.decode(msgspec.msgpack.encode({"type": "other", "step_id": 1}))
    with pytest.raises(msgspec.DecodeError):
        STEP_DECODER.decode(b"\x80\x04\x95garbage")


FORBIDDEN = re.compile(
    r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill)\b"
    r"|\bimport\s+.*\b(c?pickle|cloudpickle)\b"
    r"|\b(send|recv)_pyobj\b"
    r"|\btorch\.load\(",
    re.MULTILINE,
)


def _package_sources() -> list[Path]:
    return sorted(
        path
        for folder in PACKAGE_DIRS
        if (REPO_ROOT / folder).is_dir()
        for path in (REPO_ROOT / folder).rglob("*.py")
    )


def test_package_sources_are_found() -> None:
    names = {p.relative_to(REPO_ROOT).parts[0] for p in _package_sources()}
    assert {"protocol", "tp_worker"} <= names


def test_no_pickle_anywhere_in_the_package() -> None:
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: "
        f"{match.group(0).strip()}"
        for path in _package_sources()
        for text in [path.read_text(encoding="utf-8")]
        for match in FORBIDDEN.finditer(text)
    ]
    assert not offenders, "pickle paths in the package:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "line",
    [
        "import pickle",
        "import os, pickle",
        "from pickle import loads",
        "import cloudpickle",
        "  from cloudpickle import dumps",
        "sock.send_pyobj(x)",
        "obj = sock.recv_pyobj()",
        "state = torch.load(path)",
    ],
)
def test_pickle_pattern_catches(line: str) -> None:
    assert FORBIDDEN.search(line)


@pytest.mark.parametrize("line", ["# unpickled", "safetensors.torch.load_file(p)", "x.loads(b)"])
def test_pickle_pattern_spares(line: str) -> None:
    assert not FORBIDDEN.search(line)


@pytest.mark.parametrize(
    "message",
    [
        NodeHello(1, {"dtype": "bfloat16", "max_model_len": "4096"}),
        NodeBeat(0),
        NodeDown(2, "process tp_worker5 exited with status 1", failed=True),
    ],
    ids=["hello", "beat", "down"],
)
def test_node_link_messages_round_trip(message: msgspec.Struct) -> None:
    decoder = msgspec.msgpack.Decoder(NodeMessage)
    assert decoder.decode(msgspec.msgpack.encode(message)) == message
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode(WorkerFailed(9, "not a node message")))


def test_per_request_output_structs_are_not_tracked_by_the_collector() -> None:
    """protocol/outputs.py: a step's hundreds of output structs must not drive the cyclic
    collector in the detokenizer and frontend; decoded ones neither. Their lists still are."""
    entry = TokenEntry(7, "a", b"a", -0.5)
    position = PositionLogprobs(entry, [entry, entry])
    detokenized = DetokenizedOutput("r", "a", [7], [position])
    ids = pack(np.array([7], dtype=np.int32))
    values = pack(np.zeros((0,), dtype=np.float32))
    prompt = PromptLogprobs(0, ids, values, empty("int32", 0, 0), empty("float32", 0, 0))
    request = RequestOutput("r", ids, prompt=prompt)
    decoded = msgspec.msgpack.decode(
        msgspec.msgpack.encode(DetokenizedBatch([detokenized])), type=DetokenizedBatch
    ).outputs[0]
    decoded_request = msgspec.msgpack.decode(
        msgspec.msgpack.encode(BatchOutput([request])), type=BatchOutput
    ).outputs[0]
    for struct in (
        entry,
        position,
        detokenized,
        request,
        request.new_ids,
        prompt,
        decoded,
        decoded.logprobs[0],
        decoded.logprobs[0].top[0],
        decoded_request,
        decoded_request.new_ids,
        decoded_request.prompt,
    ):
        assert not gc.is_tracked(struct), type(struct).__name__
    assert decoded == detokenized and decoded_request == request
