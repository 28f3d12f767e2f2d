"""Controller -> detokenizer -> frontend: outputs of requests, as arrays then as text.

The controller sends compact arrays per request per step (BatchOutput); the detokenizer
turns them into text deltas and formatted logprob entries (DetokenizedBatch) that the
frontend only wraps into the API's response shapes.

NOTE: the per-request structs here that hold lists or other structs (and Array) are
`gc=False`: the cyclic collector neither tracks nor scans them (msgspec already leaves out a
struct of plain values, such as TokenEntry). At batch 64 with top-5 logprobs the frontend
ran a collection for about every frame it decoded (271 collections, 0.15 s of its CPU over
16,384 tokens; 22 and 0.003 s with these untracked). Safe because none can be part of a
reference cycle: their fields are numbers, strings, bytes and lists or structs of those, and
no code puts a struct into its own lists.
"""

from __future__ import annotations

import builtins

import msgspec

from tokenmill.protocol.arrays import Array
from tokenmill.protocol.requests import DetokenizeParams

# Why a request ended, in OpenAI's words ("abort" and "error" are ours).
FINISH_REASONS = ("stop", "length", "abort", "error")
# NOTE: a request whose LoRA adapter is not loaded when it arrives (a 404, as an unknown model)
NO_ADAPTER = "no_adapter"


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Prompt tokens from position `start`; logprobs from max(start, 1): position 0 has none."""

    start: int
    token_ids: Array  # [P - start] int32
    logprobs: Array  # [P - max(start, 1)] float32
    top_ids: Array  # [P - max(start, 1), K] int32
    top_logprobs: Array  # [P - max(start, 1), K] float32


class RequestOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """New output of one request since its last RequestOutput (n = new tokens)."""

    req_id: str
    new_ids: Array  # [n] int32
    logprobs: Array | None = None  # [n] float32, when asked
    top_ids: Array | None = None  # [n, K] int32, when num_top > 0
    top_logprobs: Array | None = None  # [n, K] float32
    token_ids_logprobs: Array | None = None  # [n, M] float32, when token_ids were given
    prompt: PromptLogprobs | None = None  # once, with the first output, when asked
    finish_reason: str | None = None
    finish_detail: str | None = None  # the stop token id or the error message
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    detokenize: DetokenizeParams | None = None  # with the request's first output only
    # With the last output, where the request asked (GenerateRequest.routed_experts_start):
    # [N, num_layers, top_k] int16 each position's experts, best first; -1 in dense layers
    routed_experts: Array | None = None


class BatchOutput(msgspec.Struct, frozen=True, tag="batch_output"):
    outputs: list[RequestOutput]


class TokenEntry(msgspec.Struct, frozen=True, array_like=True):
    """One logprob entry as the APIs show it: token string, its exact bytes, its value."""

    token_id: int
    token: str  # the UTF-8 text, or "bytes:\\xNN..." when not valid UTF-8 by itself
    # NOTE: builtins.bytes, since the field's own name shadows the type inside the class.
    bytes: builtins.bytes | None  # None for special tokens with no byte form
    logprob: float | None  # clamped to -9999.0 for -inf / NaN; None: prompt position 0


class PositionLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    chosen: TokenEntry
    top: list[TokenEntry] = []
    token_ids_logprobs: list[float] = []  # aligned with the request's token_ids


class DetokenizedOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    req_id: str
    text: str  # new text since the last output (stop strings and what follows removed)
    token_ids: list[int]  # new output ids (small: a step's worth)
    logprobs: list[PositionLogprobs] = []  # one per new token, when asked
    prompt_logprobs: list[PositionLogprobs] = []  # once, from start (position 0: logprob None)
    finish_reason: str | None = None
    finish_detail: str | None = None  # matched stop string / stop token id / error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_cached_tokens: int = 0
    # RequestOutput.routed_experts as SGLang returns them: base64 of the int32 array's bytes
    routed_experts: str | None = None


class DetokenizedBatch(msgspec.Struct, frozen=True, tag="detokenized"):
    outputs: list[DetokenizedOutput]
