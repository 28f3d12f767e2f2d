"""Response shape of the native /generate API, as SGLang returns it (main process).

`{"text", "output_ids", "meta_info": {...}}` per choice (a list for a batch or n > 1);
logprob entries are `[logprob, token_id, text or null]`, the first prompt token's logprob
null. Streamed chunks are cumulative, as SGLang's are by default.
"""

from __future__ import annotations

from typing import Any

from tokenmill.frontend.api.openai_responses import ChoiceState, Responder
from tokenmill.protocol.outputs import DetokenizedOutput, PositionLogprobs, TokenEntry

Entry = list[Any]  # [logprob | None, token_id, text | None]


class NativeResponder(Responder):
    sglext_in_chunks = False  # NOTE: meta_info carries them

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keep = True  # chunks are cumulative
        self._with_text = self.parsed.text_in_logprobs

    def _entry(self, e: TokenEntry) -> Entry:
        return [e.logprob, e.token_id, e.token if self._with_text else None]

    def _id_entry(self, logprob: float | None, token_id: int) -> Entry:
        text = self.tokenizer.token_text(token_id) if self._with_text else None
        return [logprob, token_id, text]

    def _finish(self, s: ChoiceState) -> dict[str, Any] | None:
        reason, detail = s.finish_reason, s.finish_detail
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": s.num_output_tokens}
        if reason == "stop":
            stop_ids = s.choice.request.sampling.stop_token_ids
            is_id = detail is not None and detail.isdigit() and int(detail) in stop_ids
            return {"type": "stop", "matched": int(detail) if is_id else detail}
        return {"type": reason, "message": detail}

    def _input_logprobs(self, s: ChoiceState) -> dict[str, Any]:
        start = max(s.choice.request.logprobs.prompt_start, 0)
        del start  # the entries carry their own ids
        tokens: list[Entry] = []
        tops: list[list[Entry] | None] = []
        for p in s.prompt_logprobs:
            tokens.append(self._entry(p.chosen))
            tops.append(None if p.chosen.logprob is None else [self._entry(t) for t in p.top])
        return {"input_token_logprobs": tokens, "input_top_logprobs": tops}

    def _output_logprobs(self, positions: list[PositionLogprobs], s: ChoiceState) -> dict:
        lp = s.choice.request.logprobs
        meta: dict[str, Any] = {}
        if lp.return_logprob:
            meta["output_token_logprobs"] = [self._entry(p.chosen) for p in positions]
            meta["output_top_logprobs"] = [[self._entry(t) for t in p.top] for p in positions]
        if lp.token_ids:
            meta["output_token_ids_logprobs"] = [
                [
                    self._id_entry(v, i)
                    for v, i in zip(p.token_ids_logprobs, lp.token_ids, strict=False)
                ]
                for p in positions
            ]
        return meta

    def result(self, s: ChoiceState) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": s.choice.request.req_id,
            "finish_reason": self._finish(s),
            "prompt_tokens": s.num_prompt_tokens or len(s.choice.prompt_ids),
            "completion_tokens": s.num_output_tokens,
            "cached_tokens": s.num_cached_tokens,
            "weight_version": self.weight_version(),
        }
        if s.routed_experts is not None:
            meta["routed_experts"] = s.routed_experts
            meta["routed_experts_start_len"] = s.choice.request.routed_experts_start
        if s.choice.request.logprobs.return_logprob:
            meta.update(self._input_logprobs(s))
        meta.update(self._output_logprobs(s.logprobs, s))
        return {"text": s.text, "output_ids": list(s.token_ids), "meta_info": meta}

    def chunks(self, state: ChoiceState, out: DetokenizedOutput, first: bool) -> list[Any]:
        if not (out.text or out.token_ids or out.finish_reason is not None or first):
            return []
        result = self.result(state)
        if self.parsed.batched:
            result["index"] = state.choice.index
        return [result]

    def response(self) -> Any:
        results = [self.result(s) for s in self.states]
        return results if self.parsed.batched else results[0]

    def final_chunks(self) -> list[Any]:
        return []
