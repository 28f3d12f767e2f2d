"""Controller <-> tp_worker channel: one ForwardBatch per step, one StepResult back (rank 0).

A step carries only what changed: new tokens, the KV slots they go to, rows of the worker's
request->slot table to fill from the prefix cache, and per-row sampling / logprob asks, as
parallel integer and float arrays. B rows, T = sum(extend_lens) new tokens.
"""

from __future__ import annotations

import msgspec

from tokenmill.protocol.arrays import Array
from tokenmill.protocol.control import WorkerCommand, WorkerCommandDone


class PenaltyBatch(msgspec.Struct, frozen=True, array_like=True):
    """Per-row repetition penalties, sent only when a row of the batch uses one.

    The worker keeps, per table row, the counts of the request's generated tokens and which
    tokens its prompt holds, counted from the tokens each step feeds the model (a generated
    token is fed back the step after it is sampled, or the next multi-step iteration).
    """

    presence: Array  # [B] float32 OpenAI presence_penalty; 0 = off
    frequency: Array  # [B] float32 OpenAI frequency_penalty; 0 = off
    repetition: Array  # [B] float32 HF repetition_penalty over prompt + output; 1 = off
    num_prompt_tokens: Array  # [B] int32: fed tokens at positions >= this are generated ones
    # [B] bool: the row starts its request in this step (first step after an admission): the
    # worker forgets what the row counted before, then counts history_ids and the step's tokens.
    restart: Array
    history_offsets: Array  # [B+1] int32: row b's history is history_ids[o[b]:o[b+1]]
    history_ids: Array  # [H] int32 tokens at positions [0, prefix_lens[b]) of restarting rows


class LogitBias(msgspec.Struct, frozen=True, array_like=True):
    """Per-row additive logit bias (OpenAI `logit_bias`), sent only when a row has one."""

    offsets: Array  # [B+1] int32: row b adds values[o[b]:o[b+1]] to the logits of ids[...]
    ids: Array  # [L] int32
    values: Array  # [L] float32 in [-100, 100]


class StopBan(msgspec.Struct, frozen=True, array_like=True):
    """min_tokens: stop ids masked to -inf while a row's output is shorter than min_tokens."""

    # [B] int32: decode iterations, from the step's first, whose sample must not be a stop id
    # (min_tokens - outputs so far, at least 0).
    num_steps: Array
    ban_eos: Array  # [B] bool: the model's eos ids are stop ids too (not ignore_eos)
    offsets: Array  # [B+1] int32: row b's stop ids are ids[o[b]:o[b+1]]
    ids: Array  # [S] int32 stop_token_ids of rows with num_steps > 0


class GrammarRows(msgspec.Struct, frozen=True, array_like=True):
    """Rows whose sample a grammar constrains: only the ids their bitmask allows are drawn.

    The mask of a decode row depends on the token the step before sampled, which the
    controller may not know when it sends the batch (overlap scheduling): then `bitmask` is
    None and the masks come in the GrammarMask message that follows the batch on the same
    channel; the worker reads it once the forward pass is done, just before sampling.
    """

    rows: Array  # [G] int32 batch rows, ascending
    # [G, ceil(V / 32)] int32: bit i % 32 of word i // 32 allows id i. A step that verifies
    # drafts (N iterations) has [N * G, W]: iteration i's masks are rows [i * G, (i + 1) * G),
    # each after the row's drafts before position i.
    bitmask: Array | None = None


class SamplingBatch(msgspec.Struct, frozen=True, array_like=True):
    """Per-row sampling parameters; rows mid-prompt carry them too (they are ignored)."""

    temperature: Array  # [B] float32; 0 = greedy
    top_k: Array  # [B] int32; 0 = no top-k filter
    top_p: Array  # [B] float32; 1 = no nucleus filter
    min_p: Array  # [B] float32; 0 = no min-p filter
    seed: Array  # [B] int64; noise is a hash of (seed, position), so reruns reproduce
    # Logit changes before temperature and filters, in this order: stop ban, bias, penalties.
    # None = no row of the batch has one (the logits are then used exactly as computed).
    stop_ban: StopBan | None = None
    logit_bias: LogitBias | None = None
    penalties: PenaltyBatch | None = None
    # Applied last, to the logits sampled from (raw logprobs are of the unmasked logits).
    grammar: GrammarRows | None = None


class LogprobAsks(msgspec.Struct, frozen=True, array_like=True):
    """What each row wants back besides the sampled token and its logprob."""

    num_top: Array  # [B] int32 top logprobs per scored position; 0 = none (<= 20)
    token_ids_offsets: Array  # [B+1] int32: row b scores token_ids[o[b]:o[b+1]]
    token_ids: Array  # [M] int32 caller-given ids scored at every sampled position
    # Prompt logprobs: the chunk scores prompt positions p >= prompt_start[b] (p >= 1) that
    # its hidden states predict; -1 = none. prompt_next_id[b] is the prompt token right after
    # the chunk (the target of its last position), -1 when the chunk ends the prompt.
    prompt_start: Array  # [B] int32
    prompt_next_id: Array  # [B] int32
    # NOTE: False when no row reads a logprob of its sampled tokens (LogprobParams.
    # reads_samples): the worker then skips their log-softmax and sends NaN for them.
    sampled: bool = True
    # [B] bool rows whose sampled logprobs are processed (LogprobParams.processed); None:
    # none (or all, where the worker's own --logprobs-mode says processed)
    processed: Array | None = None


# NOTE: an input id the controller does not know yet (overlap scheduling: it sends step N + 1
# before step N's result is back). A decode row's token FED_LAST_SAMPLE is the last id the
# worker sampled for that table row, in the step before.
FED_LAST_SAMPLE = -1


class ForwardBatch(msgspec.Struct, frozen=True, tag="forward"):
    step_id: int
    input_ids: Array  # [T] int32 new tokens, rows concatenated in batch order; FED_LAST_SAMPLE
    out_slots: Array  # [T] int32 KV slot each new token writes
    req_rows: Array  # [B] int32 rows of the worker's request->slot table
    prefix_lens: Array  # [B] int32 tokens of the row already in the KV cache
    extend_lens: Array  # [B] int32 new tokens of the row in this step
    # [B] bool: the row's new tokens are prompt tokens (a prefill chunk), not a sampled token.
    # Prompt tokens always take the prefill attention path and sampled ones the decode path, so
    # that a token's numbers do not depend on how the prompt was chunked or cached.
    is_prefill: Array
    fill_rows: Array  # [F] int32 table rows whose first fill_lens[f] slots are (re)written
    fill_lens: Array  # [F] int32
    fill_slots: Array  # [sum(fill_lens)] int32 cached-prefix slots, rows concatenated
    sampling: SamplingBatch
    logprobs: LogprobAsks
    # Multi-step decoding: after the first token, num_steps - 1 more decode iterations run on
    # the device; decode_slots[i, b] is the slot of the row's token from iteration i + 1.
    num_steps: int = 1
    decode_slots: Array | None = None  # [num_steps - 1, B] int32
    # Speculative verification (num_steps 1): decode row b's new tokens are its last sampled
    # token and then num_drafts[b] drafts. The step samples at each of those 1 + num_drafts[b]
    # positions, as N = 1 + max(num_drafts) iterations over the one forward pass (a row with
    # fewer drafts repeats its last position; those samples are not read), and keeps a
    # row's drafts up to the first one its own sample there disagrees with. Where the workers
    # run a draft model (RunnerConfig.draft_model), the drafts in input_ids are placeholders
    # that it writes before the target's forward pass.
    num_drafts: Array | None = None  # [B] int32; None = no row has a draft
    # --enable-lora: [B] int32 the adapter slot each row runs with (-1: the base model alone);
    # None = no row has an adapter
    lora_slots: Array | None = None


class GrammarMask(msgspec.Struct, frozen=True, tag="grammar_mask"):
    """The bitmask of a batch sent with GrammarRows.bitmask None, right after it."""

    step_id: int
    bitmask: Array  # [G, ceil(V / 32)] ([N * G, W] with drafts) int32, as GrammarRows.bitmask


# What the controller sends each rank, in order: a batch, and the masks it waits for; or,
# with no step in flight, a control command (new weights, memory released or taken back).
BatchMessage = ForwardBatch | GrammarMask | WorkerCommand


class StepResult(msgspec.Struct, frozen=True, tag="step"):
    """N = num_steps; R = rows with num_top > 0 (batch order); K = max num_top."""

    step_id: int
    next_ids: Array  # [N, B] int32 sampled ids (rows mid-prompt: ignore)
    logprobs: Array  # [N, B] float32 logprob of next_ids
    top_ids: Array  # [N, R, K] int32
    top_logprobs: Array  # [N, R, K] float32
    token_ids_logprobs: Array  # [N, M] float32, aligned with LogprobAsks.token_ids
    prompt_offsets: Array  # [B+1] int32: row b's scored prompt positions are [o[b]:o[b+1]]
    prompt_logprobs: Array  # [P] float32 logprob of each scored prompt token
    prompt_top_ids: Array  # [P, Kp] int32, Kp = max num_top over rows scoring prompts
    prompt_top_logprobs: Array  # [P, Kp] float32
    # Filled when the server runs with --step-timing (0 otherwise): seconds rank 0 spent on
    # this step, from receiving the batch to sending the result, and inside the model forward
    # (layers and lm_head).
    busy_s: float = 0.0
    forward_s: float = 0.0
    # With ForwardBatch.num_drafts: [B] int32 drafts each row keeps, a leading run whose every
    # draft is the row's own sample at its position; the row's new tokens are then
    # next_ids[:num_accepted[b] + 1, b]. None: the batch had no drafts.
    num_accepted: Array | None = None
    # --enable-return-routed-experts: [S, moe layers, top_k] int16 the experts of every token
    # the step computed, in the order of its slots (out_slots, then decode_slots' rows); a
    # verifying step's rejected drafts too. None: the server returns no routed experts.
    routed_experts: Array | None = None


class RoutingShape(msgspec.Struct, frozen=True, array_like=True):
    """What StepResult.routed_experts holds per token: top_k experts in each MoE layer."""

    num_layers: int  # the model's layers, dense ones too
    moe_layers: tuple[int, ...]  # the layers with experts, ascending
    top_k: int


class WorkerReady(msgspec.Struct, frozen=True, tag="worker_ready"):
    """Rank 0, once the model is loaded and the KV cache allocated."""

    kv_cache_tokens: int  # KV slots per layer, 0..kv_cache_tokens-1
    max_model_len: int  # longest sequence a row of the request->slot table holds
    eos_token_ids: tuple[int, ...]
    routing: RoutingShape | None = None  # set where the steps return routed experts


class WorkerFailed(msgspec.Struct, frozen=True, tag="worker_failed"):
    """Rank 0 could not run a step; the controller fails the batch's requests and exits."""

    step_id: int
    message: str


WorkerMessage = WorkerReady | StepResult | WorkerFailed | WorkerCommandDone
