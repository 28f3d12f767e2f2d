"""Frontend -> controller channel: a tokenized request, an abort, or a control command
(protocol/control.py).

A request's static data crosses once, here; the controller passes `detokenize` on to the
detokenizer with the request's first output, so that channel stays ordered.
"""

from __future__ import annotations

import msgspec

from tokenmill.protocol.arrays import Array
from tokenmill.protocol.control import ControlCommand


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0  # the frontend draws one when the caller gives none
    stop_token_ids: tuple[int, ...] = ()  # end generation (kept in the output ids)
    ignore_eos: bool = False
    min_tokens: int = 0  # outputs [0, min_tokens) cannot be eos or a stop token id
    presence_penalty: float = 0.0  # OpenAI: logit - p for each token already generated
    frequency_penalty: float = 0.0  # OpenAI: logit - p * (times the token was generated)
    repetition_penalty: float = 1.0  # HF: logit / p (> 0) or * p (< 0) if in prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs


class LogprobParams(msgspec.Struct, frozen=True):
    return_logprob: bool = False  # logprob of every generated token
    num_top: int = 0  # top logprobs per scored position, 0..20
    token_ids: tuple[int, ...] = ()  # ids scored at every generated position
    prompt_start: int = -1  # score prompt tokens from this position; -1 = none
    # generated tokens' logprobs describe the distribution sampled from (after penalties,
    # temperature, filters) instead of the model's own; the frontend resolves the request's
    # `logprobs_mode` against the server's --logprobs-mode
    processed: bool = False

    @property
    def reads_samples(self) -> bool:
        """Whether any logprob of the generated positions is read: the chosen token's, the
        top or the given ids' (each comes with the chosen token's)."""
        return self.return_logprob or self.num_top > 0 or bool(self.token_ids)


class DetokenizeParams(msgspec.Struct, frozen=True):
    stop: tuple[str, ...] = ()  # stop strings, matched across token boundaries
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    text_in_logprobs: bool = True  # token strings in logprob entries (native API may not)
    # the request asked for its routed experts: where a stop string ends it, its last
    # output waits for the controller's, which carries them
    routed_experts: bool = False


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """What a request's output must match: every sampled token is masked by it."""

    # what the caller asked for (errors, logs): json_schema, json_object, regex, choice,
    # grammar or tool_call
    kind: str
    grammar: str  # the llguidance grammar (its JSON form), validated by the frontend


class GenerateRequest(msgspec.Struct, frozen=True, tag="generate"):
    req_id: str
    input_ids: Array  # [P] int32
    sampling: SamplingParams
    logprobs: LogprobParams
    detokenize: DetokenizeParams
    # Leading tokens this request shares with requests sent alongside it (a scoring
    # request's query): it waits for a running prefill of them instead of computing them too.
    shared_prefix_len: int = 0
    constraint: Constraint | None = None
    # False: never drafts, where the server runs speculative decoding (its tokens and
    # logprobs are the same either way; only the speed differs)
    speculative: bool = True
    # --enable-return-routed-experts: the experts of positions [routed_experts_start,
    # prompt + output - 1) come back with the request's last output; -1: not asked
    routed_experts_start: int = -1
    # --enable-lora: the adapter it runs with (its name, as `model` names it); "": the base
    lora_name: str = ""


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    req_id: str


FrontendMessage = GenerateRequest | AbortRequest | ControlCommand
