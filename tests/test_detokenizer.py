"""Detokenizer: token table bytes, incremental decoding, stop strings, logprob entries, wire."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from tokenizers import Tokenizer

from tokenmill.detokenizer.config import DetokenizerConfig
from tokenmill.detokenizer.detokenizer import Detokenizer, decode_frame, run_detokenizer, serve
from tokenmill.detokenizer.incremental import IncrementalDetokenizer
from tokenmill.detokenizer.logprob_format import LogprobFormatter, clamp
from tokenmill.detokenizer.token_table import TokenTable, display_string
from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.outputs import (
    BatchOutput,
    DetokenizedBatch,
    PromptLogprobs,
    RequestOutput,
)
from tokenmill.protocol.requests import AbortRequest, DetokenizeParams
from tokenmill.protocol.step_channel import FrameStream

TEXTS = (
    "héllo naïve café — déjà vu",
    "emoji 😀👍🏽 and flags 🇫🇷!",
    "中文字符和日本語のテキスト",
    "mixed: Ω≈ç√ ∫ 한국어 😀 end",
)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


@pytest.fixture(scope="module")
def table(checkpoint: Path) -> TokenTable:
    return TokenTable.from_file(checkpoint)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def fake_table(pieces: list[bytes | str]) -> TokenTable:
    """Id i is pieces[i]; a str piece is a special token with that content."""
    piece_bytes = [p if isinstance(p, bytes) else None for p in pieces]
    strings = [p if isinstance(p, str) else display_string(p) for p in pieces]
    return TokenTable(piece_bytes, strings, [isinstance(p, str) for p in pieces])


def stream(decoder: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    deltas = [decoder.feed(chunk).text for chunk in chunks]
    return [*deltas, decoder.finish().text]


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, len(ids)), k=min(len(ids) - 1, rng.randint(0, 5))))
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --- token table ---------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_utf8(
    tokenizer: Tokenizer, table: TokenTable, text: str
) -> None:
    ids = encode(tokenizer, text)
    assert b"".join(table.token_bytes(i) for i in ids) == text.encode()


def test_special_and_invalid_token_strings(tokenizer: Tokenizer, table: TokenTable) -> None:
    eos = tokenizer.token_to_id("<|end_of_text|>")
    assert eos is not None
    assert table.token_bytes(eos) is None
    assert table.token_string(eos) == "<|end_of_text|>"
    assert table.is_special(eos)
    ids = encode(tokenizer, "😀")
    partial = [i for i in ids if table.token_string(i).startswith("bytes:")]
    assert partial, "the tiny vocab should split the emoji"
    for i in partial:
        expected = "bytes:" + "".join(f"\\x{b:02x}" for b in table.token_bytes(i))
        assert table.token_string(i) == expected
    assert display_string(b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    assert display_string("é".encode()) == "é"
    assert table.token_string(len(table) + 5) == "" and table.token_bytes(-1) is None


def test_sentencepiece_style_pieces() -> None:
    from tokenizers import models

    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xE2>": 2, "▁hello": 3, "▁": 4}
    table = TokenTable.from_tokenizer(Tokenizer(models.BPE(vocab, [], byte_fallback=True)))
    assert table.token_bytes(1) == b"\n" and table.token_bytes(2) == b"\xe2"
    assert table.token_bytes(3) == b" hello" and table.token_string(4) == " "


# --- incremental decoding --------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_equals_full_decode(tokenizer: Tokenizer, table: TokenTable, text: str) -> None:
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)
    assert full == text
    one_by_one = stream(IncrementalDetokenizer(table, DetokenizeParams()), [[i] for i in ids])
    assert "".join(one_by_one) == full
    assert all("\ufffd" not in delta for delta in one_by_one)
    rng = random.Random(0)
    for _ in range(30):
        deltas = stream(IncrementalDetokenizer(table, DetokenizeParams()), random_chunks(ids, rng))
        assert "".join(deltas) == full
        assert all("\ufffd" not in delta for delta in deltas)


def test_incomplete_tail_flushed_as_replacement() -> None:
    table = fake_table([b"ok ", b"\xf0\x9f", b"\x98"])
    decoder = IncrementalDetokenizer(table, DetokenizeParams())
    assert decoder.feed([0, 1, 2]).text == "ok "
    assert decoder.finish().text == b"\xf0\x9f\x98".decode("utf-8", "replace") == "\ufffd"


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer, table: TokenTable) -> None:
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    eos = tokenizer.token_to_id("<|end_of_text|>")
    assert bos is not None and eos is not None
    ids = [bos, *encode(tokenizer, "hi there"), eos]
    skipped = stream(IncrementalDetokenizer(table, DetokenizeParams()), [[i] for i in ids])
    assert "".join(skipped) == "hi there" == tokenizer.decode(ids, skip_special_tokens=True)
    kept_params = DetokenizeParams(skip_special_tokens=False)
    kept = stream(IncrementalDetokenizer(table, kept_params), [ids])
    assert "".join(kept) == tokenizer.decode(ids, skip_special_tokens=False)
    assert "".join(kept) == "<|begin_of_text|>hi there<|end_of_text|>"


# --- stop strings ----------------------------------------------------------------------

# "Hel" "lo" " wo" "rld" "!" " 😀" (split) "END" "<s>"
PIECES: list[bytes | str] = [b"Hel", b"lo", b" wo", b"rld", b"!", b" \xf0\x9f", b"\x98\x80"]
PIECES += [b"END", "<s>"]


@pytest.mark.parametrize("include", [False, True])
def test_stop_across_tokens_and_calls(include: bool) -> None:
    params = DetokenizeParams(stop=("lo wor",), include_stop_str=include)
    decoder = IncrementalDetokenizer(fake_table(PIECES), params)
    first = decoder.feed([0, 1])  # "Hello": "lo" could start the stop string
    assert first.text == "Hel" and first.num_ids == 2 and first.stop is None
    second = decoder.feed([2, 3, 4, 7])  # " wo" "rld" completes it; "!" "END" dropped
    assert second.stop == "lo wor" and second.num_ids == 2
    assert first.text + second.text == ("Hello wor" if include else "Hel")
    assert decoder.feed([4]).text == "" and decoder.finish().text == ""


def test_stop_inside_one_token_and_earliest_match() -> None:
    params = DetokenizeParams(stop=("rld", "wo"))
    decoder = IncrementalDetokenizer(fake_table(PIECES), params)
    delta = decoder.feed([0, 1, 2, 3])
    assert (delta.text, delta.num_ids, delta.stop) == ("Hello ", 3, "wo")


def test_stop_on_a_split_character() -> None:
    decoder = IncrementalDetokenizer(fake_table(PIECES), DetokenizeParams(stop=("😀",)))
    deltas = [decoder.feed([i]) for i in (4, 5, 6, 7)]
    assert [d.text for d in deltas] == ["!", " ", "", ""]
    assert deltas[2].stop == "😀" and deltas[2].num_ids == 1


def test_held_back_text_is_released_at_finish() -> None:
    decoder = IncrementalDetokenizer(fake_table(PIECES), DetokenizeParams(stop=("loX",)))
    assert decoder.feed([0, 1]).text == "Hel"
    assert decoder.finish().text == "lo"


@pytest.mark.parametrize("include", [False, True])
def test_streamed_text_is_never_cut(tokenizer: Tokenizer, table: TokenTable, include: bool) -> None:
    text = "the cat sat on the mat; the dog ate the cat's hat 😀 and then stopped."
    ids = encode(tokenizer, text)
    stops = ("the dog", "hat 😀 and", "t's", "zzz")
    rng = random.Random(1)
    for _ in range(40):
        stop = rng.choice(stops)
        params = DetokenizeParams(stop=(stop, "never here"), include_stop_str=include)
        decoder = IncrementalDetokenizer(table, params)
        shown, kept = "", 0
        for chunk in random_chunks(ids, rng):
            delta = decoder.feed(chunk)
            shown, kept = shown + delta.text, kept + delta.num_ids
            if delta.stop:
                break
        shown += decoder.finish().text
        end = text.find(stop)
        expected = text if end < 0 else text[: end + (len(stop) if include else 0)]
        assert shown == expected
        if end >= 0:
            # the kept tokens end with the one that completed the stop string
            assert len(tokenizer.decode(ids[:kept])) >= end + len(stop)
            assert len(tokenizer.decode(ids[: kept - 1])) < end + len(stop)


# --- logprob entries ---------------------------------------------------------------------


def test_clamp_non_finite() -> None:
    values = np.array([-np.inf, np.nan, -0.5, 0.0], dtype=np.float32)
    assert clamp(values) == [-9999.0, -9999.0, -0.5, 0.0]
    assert all(type(v) is float for v in clamp(values))


def test_positions_cut_top_and_entries() -> None:
    table = fake_table(PIECES)
    formatter = LogprobFormatter(table, num_top=1, text_in_logprobs=True)
    top_ids = np.array([[5, 0, 1], [6, 2, 3]], dtype=np.int32)
    top_lp = np.array([[-0.1, -np.inf, -3], [-0.2, -1, np.nan]], dtype=np.float32)
    entries = formatter.positions([5, 6], np.array([-0.1, -np.inf], np.float32), top_ids, top_lp)
    assert [len(e.top) for e in entries] == [1, 1]
    assert entries[0].chosen.token == "bytes:\\x20\\xf0\\x9f"
    assert entries[0].chosen.bytes == b" \xf0\x9f"
    assert entries[1].chosen.logprob == -9999.0
    assert entries[1].top[0].token_id == 6
    native = LogprobFormatter(table, num_top=None, text_in_logprobs=False)
    wide = native.positions([0], np.array([-1.0], np.float32), top_ids[:1], top_lp[:1])
    assert [e.token for e in wide[0].top] == ["", "", ""]
    assert [e.bytes for e in wide[0].top] == [b" \xf0\x9f", b"Hel", b"lo"]
    assert [e.logprob for e in wide[0].top][1] == -9999.0


@pytest.mark.parametrize("num_top", [None, 2])
def test_output_entries_equal_those_of_the_unpacked_arrays(num_top: int | None) -> None:
    """A step's output (read as lists) gives the entries `positions` builds from the arrays:
    the same values, -inf and NaN clamped, top cut to num_top, rows past the kept ids cut."""
    formatter = LogprobFormatter(fake_table(PIECES), num_top=num_top, text_in_logprobs=True)
    out = wire_output(
        RequestOutput(
            "r",
            pack(np.array([5, 6, 0], np.int32)),
            pack(np.array([-0.1, -np.inf, np.nan], np.float32)),
            pack(np.array([[5, 0, 1], [6, 2, 3], [0, 1, 2]], np.int32)),
            pack(np.array([[-0.1, -np.inf, -3], [-0.2, -1, np.nan], [0, 0, 0]], np.float32)),
            pack(np.array([[-1.25, np.nan], [-np.inf, -2.5], [0, 0]], np.float32)),
        )
    )
    kept = [5, 6]  # a stop string cut the third
    arrays = [unpack(a) for a in (out.logprobs, out.top_ids, out.top_logprobs)]
    want = formatter.positions(kept, *arrays, unpack(out.token_ids_logprobs))
    got = formatter.output(out, kept)
    assert got == want
    assert [len(p.top) for p in got] == [num_top or 3] * 2
    assert got[1].chosen.logprob == -9999.0 and got[0].token_ids_logprobs == [-1.25, -9999.0]
    assert all(type(e.logprob) is float for p in got for e in [p.chosen, *p.top])


def wire_output(out: RequestOutput) -> RequestOutput:
    return msgspec.msgpack.Decoder(RequestOutput).decode(msgspec.msgpack.encode(out))


@pytest.mark.parametrize("start", [0, 1, 2])
def test_prompt_logprobs(start: int) -> None:
    table = fake_table(PIECES)
    prompt_ids = [0, 1, 2, 3]
    first = max(start, 1)
    n = len(prompt_ids) - first
    prompt = PromptLogprobs(
        start,
        pack(np.array(prompt_ids[start:], np.int32)),
        pack(np.full(n, -1.5, np.float32)),
        pack(np.zeros((n, 2), np.int32)),
        pack(np.full((n, 2), -np.inf, np.float32)),
    )
    entries = LogprobFormatter(table, 2, True).prompt(prompt)
    assert len(entries) == len(prompt_ids) - start
    assert (entries[0].chosen.logprob is None) == (start == 0)
    if start == 0:
        assert entries[0].chosen.token_id == prompt_ids[0] and entries[0].top == []
    scored = [e for e in entries if e.chosen.logprob is not None]
    assert [e.chosen.token_id for e in scored] == prompt_ids[first:]
    assert all(e.chosen.logprob == -1.5 and e.top[0].logprob == -9999.0 for e in scored)


# --- the Detokenizer end to end, through the wire format ------------------------------


def request_output(req_id: str, ids: list[int], **kwargs: object) -> RequestOutput:
    n = len(ids)
    logprobs = pack(np.linspace(-0.1, -1.0, n, dtype=np.float32)) if n else None
    return RequestOutput(req_id, pack(np.array(ids, np.int32)), logprobs, **kwargs)


PROMPT = PromptLogprobs(
    0,
    pack(np.array([7, 0, 1], np.int32)),
    pack(np.array([-2.0, -np.inf], np.float32)),
    pack(np.zeros((2, 0), np.int32)),
    pack(np.zeros((2, 0), np.float32)),
)


def wire(msg: BatchOutput) -> BatchOutput:
    return msgspec.msgpack.Decoder(BatchOutput).decode(msgspec.msgpack.encode(msg))


def test_detokenizer_end_to_end() -> None:
    detok = Detokenizer(fake_table(PIECES))
    stop_params = DetokenizeParams(stop=("wor",))
    steps = [
        [
            request_output(
                "a", [0, 1], detokenize=DetokenizeParams(), num_prompt_tokens=3, prompt=PROMPT
            ),
            request_output("b", [0], detokenize=stop_params, num_prompt_tokens=2),
        ],
        [request_output("a", [2, 5]), request_output("b", [1, 2, 3, 4])],
        [request_output("a", [6, 8], finish_reason="stop", finish_detail="8")],
        [request_output("b", [4], finish_reason="abort")],  # after our stop: dropped
    ]
    results: list[DetokenizedBatch] = []
    for outputs in steps:
        batch = detok.handle_batch_output(wire(BatchOutput(outputs)))
        msgspec.msgpack.encode(batch)  # what the frontend receives (typed decode: below)
        results.append(batch)
        if len(results) == 2:
            assert detok.stopped_req_ids == ["b"]
    by_req: dict[str, list] = {"a": [], "b": []}
    for batch in results:
        for out in batch.outputs:
            by_req[out.req_id].append(out)
    a, b = by_req["a"], by_req["b"]
    assert "".join(o.text for o in a) == "Hello wo 😀"
    assert [o.num_output_tokens for o in a] == [2, 4, 6]
    assert a[-1].finish_reason == "stop" and a[-1].finish_detail == "8"
    assert len(a[0].logprobs) == 2 and a[0].logprobs[0].chosen.bytes == b"Hel"
    assert a[0].prompt_logprobs[0].chosen.logprob is None and len(a[0].prompt_logprobs) == 3
    assert [o.prompt_logprobs for o in a[1:]] == [[], []]
    assert "".join(o.text for o in b) == "Hello "
    assert b[-1].finish_reason == "stop" and b[-1].finish_detail == "wor"
    assert b[-1].token_ids == [1, 2, 3] and len(b[-1].logprobs) == 3
    assert len(b) == 2 and detok.num_running == 0


def test_detokenized_batch_typed_round_trip() -> None:
    detok = Detokenizer(fake_table(PIECES))
    msg = BatchOutput([request_output("r", [0, 5, 6], detokenize=DetokenizeParams())])
    batch = detok.handle_batch_output(msg)
    decoded = msgspec.msgpack.Decoder(DetokenizedBatch).decode(msgspec.msgpack.encode(batch))
    assert decoded == batch


def test_output_of_an_unannounced_request_is_logged_not_fatal(caplog) -> None:
    """The controller sends DetokenizeParams with each request's first output; if a bug ever
    drops them, the detokenizer (and so the server) must survive it."""
    detok = Detokenizer(fake_table(PIECES))
    batch = detok.handle_batch_output(BatchOutput([request_output("x", [0])]))
    assert [out.req_id for out in batch.outputs] == ["x"]
    assert "first output of x has no detokenize params" in caplog.text


def test_run_detokenizer_exits_non_zero_on_failure(tmp_path: Path) -> None:
    config = DetokenizerConfig(str(tmp_path / "missing"), "inproc://in", "inproc://out")
    with pytest.raises(SystemExit) as exit_info:
        run_detokenizer(config)
    assert exit_info.value.code == 1


def test_garbage_frame_raises_and_is_dropped() -> None:
    decoder = msgspec.msgpack.Decoder(BatchOutput)
    for frame in (b"\x00garbage", msgspec.msgpack.encode({"type": "batch_output", "x": 1})):
        with pytest.raises(msgspec.DecodeError):
            decoder.decode(frame)
        assert decode_frame(decoder, frame) is None


def _serve_config(tmp_path: Path, parent_check_s: float = 30.0) -> DetokenizerConfig:
    return DetokenizerConfig(
        tokenizer_path=str(tmp_path),
        input_addr=f"unix://{tmp_path}/in",
        output_addr=f"ipc://{tmp_path}/out",
        abort_addr=f"ipc://{tmp_path}/aborts",
        parent_pid=-1,  # never our parent: the loop ends at the first check
        parent_check_s=parent_check_s,
    )


def test_serve_loop(tmp_path: Path) -> None:
    """Outputs in through the frame stream (a garbage frame dropped), text out, the stop
    string's abort to the controller; the loop ends when the controller closes its end."""
    config = _serve_config(tmp_path)
    ctx = zmq.Context()
    try:
        results = ctx.socket(zmq.PULL)
        results.bind(config.output_addr)
        aborts = ctx.socket(zmq.PULL)
        aborts.bind(config.abort_addr)
        thread = threading.Thread(target=serve, args=(Detokenizer(fake_table(PIECES)), config, ctx))
        thread.start()
        sender = FrameStream.connect(config.input_addr)
        sender.send(b"not a message")
        stopped = request_output("s", [0, 1, 2], detokenize=DetokenizeParams(stop=("lo",)))
        msg = BatchOutput([request_output("r", [0, 1], detokenize=DetokenizeParams()), stopped])
        sender.send(msgspec.msgpack.encode(msg))
        assert results.poll(5000)
        batch = msgspec.msgpack.Decoder(DetokenizedBatch).decode(results.recv())
        assert (batch.outputs[0].text, batch.outputs[0].token_ids) == ("Hello", [0, 1])
        assert batch.outputs[1].finish_reason == "stop"
        # The request it ended on a stop string is aborted at the controller; only that one.
        assert aborts.poll(5000)
        assert msgspec.msgpack.Decoder(AbortRequest).decode(aborts.recv()) == AbortRequest("s")
        assert not aborts.poll(200)
        sender.close()  # NOTE: the controller gone: the loop ends long before a parent check
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)


def test_serve_loop_ends_when_the_parent_is_gone(tmp_path: Path) -> None:
    """No controller ever connects: the parent check still ends the loop."""
    config = _serve_config(tmp_path, parent_check_s=0.2)
    ctx = zmq.Context()
    try:
        thread = threading.Thread(target=serve, args=(Detokenizer(fake_table(PIECES)), config, ctx))
        thread.start()
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)
