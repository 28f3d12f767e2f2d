"""Tokenization as transformers does it, on every kind of test checkpoint: byte-level
(llama, qwen2, mistral), a qwen2 checkpoint whose plain byte-level tokenizer.json
transformers' Qwen2Tokenizer overrides, and SentencePiece-style ones ("▁" dummy prefix,
<0xNN> byte fallback). Through the real server: echo's text_offset indexes the echoed text,
byte pieces carry their exact bytes, and stop strings match across byte-fallback pieces."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from server_process import ServerProcess, start_server

from tokenmill.detokenizer.detokenizer import Detokenizer
from tokenmill.detokenizer.token_table import TokenTable
from tokenmill.frontend.api.chat_template import ChatTemplate
from tokenmill.frontend.tokenizer import Tokenizer
from tokenmill.protocol.arrays import pack
from tokenmill.protocol.outputs import BatchOutput, RequestOutput
from tokenmill.protocol.requests import DetokenizeParams

CHECKPOINTS = [
    ("llama", "auto"),
    ("qwen2", "auto"),
    ("mistral", "auto"),
    ("qwen2", "byte-level"),  # transformers' Qwen2Tokenizer overrides its tokenizer.json
    ("llama", "sentencepiece"),
    ("mistral", "sentencepiece"),
]
PROMPTS = [
    "def add(a, b):\n    return a + b  # sum\n\n\nprint(add(12345, 678))\n",
    "Ünïcödé: naïve café, 東京, Ελληνικά, עברית",
    "emoji 🎉🚀 and a flag 🇫🇷, zero-width\u200bjoiner",
    "   leading spaces, then\ttabs\tand trailing spaces   ",
    "digits 0 1 22 333 4444 55555 3.14159 1e-9 -42",
    "\n\nnewlines\r\nand\n\n\n\nmore",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "Hello there 👋"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": " Paris"},
        {"role": "user", "content": "And of Japan?\n"},
    ],
]


@pytest.mark.parametrize(("arch", "kind"), CHECKPOINTS)
def test_text_and_chat_ids_equal_transformers(tiny_checkpoint, arch: str, kind: str) -> None:
    model_dir = tiny_checkpoint(arch, kind)
    ours = Tokenizer(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in PROMPTS:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special)
    assert ours.chat_template is not None
    template = ChatTemplate(ours.chat_template, ours.bos_token, ours.eos_token)
    for messages in MESSAGES:
        rendered = ours.encode(template.render(messages), add_special_tokens=False)
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert rendered == list(expected.get("input_ids", expected))


def test_the_qwen2_override_case_really_differs_from_tokenizer_json(tiny_checkpoint) -> None:
    """Guard for the case above: following tokenizer.json would give other ids here."""
    import tokenizers

    model_dir = tiny_checkpoint("qwen2", "byte-level")
    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    differs = [t for t in PROMPTS if raw.encode(t).ids != Tokenizer(model_dir).encode(t)]
    assert differs, "the override case no longer overrides anything"


@pytest.fixture(scope="module")
def sentencepiece_server(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("sp") / "server.log"
    server = start_server(
        tiny_checkpoint("mistral", "sentencepiece"), log, "--kv-cache-tokens", "4096"
    )
    yield server
    assert server.stop() == 0


def test_the_server_counts_and_scores_the_ids_transformers_makes(tiny_checkpoint, tmp_path) -> None:
    """The issue's case through the API: a qwen2 checkpoint whose tokenizer.json
    transformers' Qwen2Tokenizer overrides; echo scores one logprob per transformers id."""
    model_dir = tiny_checkpoint("qwen2", "byte-level")
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    server = start_server(model_dir, tmp_path / "log", "--kv-cache-tokens", "4096")
    try:
        prompt = PROMPTS[0]
        body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "echo": True}
        status, reply = server.post("/v1/completions", {**body, "logprobs": 0})
        assert status == 200, reply
        expected = theirs.encode(prompt)
        assert reply["usage"]["prompt_tokens"] == len(expected)
        assert len(reply["choices"][0]["logprobs"]["tokens"]) == len(expected) + 1
        check_echo_offsets(server, prompt)
    finally:
        assert server.stop() == 0


ECHOED = ["The quick naïve 😀 fox", "Ünïcödé 東京\n\tend", "x=12345; y = x ** 2"]


def check_echo_offsets(server: ServerProcess, prompt: str) -> None:
    """Each token's offset is the number of characters its predecessors complete, and their
    bytes together spell the echoed text: offsets index the text."""
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "echo": True}
    status, reply = server.post("/v1/completions", {**body, "logprobs": 1, "temperature": 0})
    assert status == 200, reply
    choice = reply["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith(prompt)
    spelled = b""
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert offset == len(spelled.decode(errors="ignore")), (token, offset, text)
        if not (token.startswith("<|") and token.endswith("|>")):  # special: no text
            spelled += _token_bytes(token)
    assert spelled.decode(errors="replace") == text


def _token_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode()


@pytest.mark.parametrize("prompt", ECHOED)
def test_echo_offsets_index_the_echoed_text_byte_level(server, prompt: str) -> None:
    check_echo_offsets(server, prompt)


@pytest.mark.parametrize("prompt", ECHOED)
def test_echo_offsets_index_the_echoed_text_sentencepiece(sentencepiece_server, prompt) -> None:
    check_echo_offsets(sentencepiece_server, prompt)


def test_byte_pieces_carry_their_bytes(sentencepiece_server) -> None:
    """ "ï" and "😀" are not in the tiny vocabulary: <0xNN> pieces, shown as OpenAI does."""
    body = {"model": sentencepiece_server.model, "prompt": "naïve 😀", "max_tokens": 1}
    status, reply = sentencepiece_server.post(
        "/v1/completions", {**body, "echo": True, "logprobs": 0}
    )
    assert status == 200, reply
    tokens = reply["choices"][0]["logprobs"]["tokens"]
    assert {"bytes:\\xc3", "bytes:\\xaf", "bytes:\\xf0", "bytes:\\x9f"} <= set(tokens)
    status, chat = sentencepiece_server.post(
        "/v1/chat/completions",
        {
            "model": sentencepiece_server.model,
            "messages": [{"role": "user", "content": "😀"}],
            "max_tokens": 8,
            "logprobs": True,
        },
    )
    assert status == 200, chat
    for entry in chat["choices"][0]["logprobs"]["content"]:
        if entry["bytes"] is None:  # a special token: no byte form
            continue
        data = bytes(entry["bytes"])
        shown = data.decode() if _utf8(data) else "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        assert entry["token"] == shown


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_incremental_text_and_stop_strings_across_byte_pieces(tiny_checkpoint) -> None:
    """Ids fed one at a time decode to what transformers decodes; a stop string made of a
    character split over byte pieces is found and cut."""
    model_dir = tiny_checkpoint("mistral", "sentencepiece")
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = " naïve 😀 café, done"
    ids = theirs.encode(text, add_special_tokens=False)
    assert any(theirs.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    table = TokenTable.from_file(model_dir)

    def run(stop: tuple[str, ...]) -> str:
        detokenizer = Detokenizer(table)
        params = DetokenizeParams(stop=stop)
        out = ""
        for k, token_id in enumerate(ids):
            last = k == len(ids) - 1
            output = RequestOutput(
                "r",
                pack(np.array([token_id], np.int32)),
                finish_reason="length" if last else None,
                detokenize=params if k == 0 else None,
            )
            (result,) = detokenizer.handle_batch_output(BatchOutput([output])).outputs or [None]
            if result is not None:
                out += result.text
                if result.finish_reason is not None:
                    break
        return out

    # NOTE: generated text continues a prompt: its first "▁" is a real space, which
    # transformers' decode of these ids alone drops as a dummy prefix
    assert run(()) == " " + theirs.decode(ids, skip_special_tokens=True)
    assert run(("😀",)) == " naïve "
    assert run(("é,",)) == " naïve 😀 caf"


def test_the_frontend_never_imports_torch(tiny_checkpoint, tmp_path) -> None:
    """transformers builds the pipeline in a subprocess (cached); the frontend runs it with
    `tokenizers` alone, so its process carries no torch (2-3 s and ~250 MB)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from tokenmill.frontend.tokenizer import Tokenizer; "
        f"t = Tokenizer({str(tiny_checkpoint('qwen2', 'byte-level'))!r}); "
        "print(len(t.encode('x = 12345')), 'torch' in sys.modules)"
    )
    env = {**os.environ, "TOKENMILL_CACHE": str(tmp_path)}  # NOTE: a cold cache
    for _ in range(2):  # built, then read from the cache
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        assert out[1] == "False"
    assert list((tmp_path / "tokenizers").glob("*.json"))
