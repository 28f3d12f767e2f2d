"""A draft model for speculative decoding, run beside the target by the same workers
(tp_worker).

The draft is a smaller checkpoint with the target's tokenizer. Its KV cache has the target's
slots (the controller's one allocator serves both) and it computes every token the target
computes, so its cache is whole wherever the target's is: prefix-cache hits, preemptions and
recomputed prompt positions need nothing of their own. A step whose rows draft (their
drafts arrive as placeholders) first has the draft write them: one pass over each row's
tokens before its drafts, then one single-token pass per draft position. Each draft is
sampled with the row's sampling parameters and the noise the target's own sample at that
position draws (keyed by seed and position), so where the two models agree the draft is the
target's sample. The target then verifies as for any drafts: which drafts come changes how
many tokens a step keeps, never a token or a logprob.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from tokenmill.tp_worker.model.attention import plan_attention
from tokenmill.tp_worker.model.config import load_model_config
from tokenmill.tp_worker.model.decoder import CausalLM, local_kv_heads
from tokenmill.tp_worker.model.parallel import TpGroup
from tokenmill.tp_worker.model.weights import dummy_weights, load_weights
from tokenmill.tp_worker.sample.sampling import sample
from tokenmill.tp_worker.step_inputs import StepInputs


class DraftModel:
    def __init__(
        self,
        path: str,
        group: TpGroup,
        dtype: torch.dtype,
        device: torch.device,
        cpu_kernels: bool,
        attention_backend: str,
        dummy: bool = False,
    ) -> None:
        self.config = load_model_config(path)
        self.group = group
        self.model = CausalLM(self.config, group, dtype, device)
        if dummy:
            dummy_weights(self.model)
        else:
            load_weights(self.model, Path(path))
        self.model.eval()
        if cpu_kernels:
            self.model.use_cpu_kernels()
        else:
            self.model.dequantize_blocks()
        if attention_backend == "triton":
            self.model.use_triton_kernels()
        self.cpu_kernels = cpu_kernels
        self.backend = attention_backend
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def kv_bytes_per_token(self, itemsize: int) -> int:
        heads = local_kv_heads(self.config, self.group)
        return 2 * heads * self.config.head_dim * itemsize * self.config.num_layers

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """The KV cache, with the target's slot count (head-major, as the target's)."""
        shape = (local_kv_heads(self.config, self.group), num_slots, self.config.head_dim)
        self.kv_cache = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(self.config.num_layers)
        ]

    @torch.inference_mode()
    def follow(self, table: torch.Tensor, inputs: StepInputs) -> None:
        """The step's new tokens into the draft's cache (the table already holds their slots)."""
        self._forward(
            table,
            inputs.input_ids,
            inputs.positions,
            inputs.out_slots,
            inputs.token_rows,
            inputs.req_rows,
            inputs.prefix_lens,
            inputs.extend_lens,
            inputs.starts,
            inputs.is_prefill,
        )

    @torch.inference_mode()
    def propose(self, table: torch.Tensor, inputs: StepInputs) -> StepInputs:
        """`inputs` of a verifying step with its drafts written: each row's placeholders
        replaced by the draft model's tokens (and the verify plan comparing with those)."""
        verify = inputs.verify
        assert verify is not None
        device = inputs.input_ids.device
        num_drafts = verify.num_drafts  # [B]
        drafting = np.flatnonzero(num_drafts > 0)
        extend = inputs.extend_lens.cpu().numpy() - num_drafts  # [B] tokens before the drafts
        placeholders = verify.draft_at[verify.draft_at >= 0]
        keep = np.setdiff1d(np.arange(len(inputs.input_ids)), placeholders)
        starts = np.cumsum(extend) - extend
        kept = torch.from_numpy(keep).to(device)
        hidden = self._forward(
            table,
            inputs.input_ids[kept],
            inputs.positions[kept],
            inputs.out_slots[kept],
            inputs.token_rows[kept],
            inputs.req_rows,
            inputs.prefix_lens,
            torch.from_numpy(extend).to(device),
            torch.from_numpy(starts).to(device),
            inputs.is_prefill,
        )
        # NOTE: per row, the position of its last token before the drafts
        last_pos = inputs.prefix_lens.cpu().numpy() + extend - 1
        last = torch.from_numpy((starts + extend - 1)[drafting]).to(device)
        rows = drafting
        token = self._sample(hidden[last], inputs, rows, last_pos[rows] + 1)  # [R] first drafts
        ids = inputs.input_ids.clone()
        for i in range(int(num_drafts.max())):
            # NOTE: token[j] is draft i (from 0) of batch row rows[j], at position
            # last_pos + 1 + i; a pass over it gives the draft after it.
            at = torch.from_numpy(verify.draft_at[i, rows]).to(device)
            ids[at] = token
            more = num_drafts[rows] > i + 1
            if not more.any():
                break
            rows, at = rows[more], at[torch.from_numpy(more).to(device)]
            token = token[torch.from_numpy(more).to(device)]
            pos = last_pos[rows] + 1 + i
            hidden = self._decode(table, inputs, rows, token, pos, at)
            token = self._sample(hidden, inputs, rows, pos + 1)
        return _with_drafts(inputs, ids)

    @torch.inference_mode()
    def complete(self, table: torch.Tensor, inputs: StepInputs, accepted: np.ndarray) -> None:
        """The last draft's key and value, for rows that kept every draft: the one token a
        row keeps that the draft passes before verification did not compute."""
        verify = inputs.verify
        assert verify is not None
        full = np.flatnonzero((verify.num_drafts > 0) & (accepted == verify.num_drafts))
        if not len(full):
            return
        device = inputs.input_ids.device
        at_np = verify.draft_at[verify.num_drafts[full] - 1, full]
        at = torch.from_numpy(at_np).to(device)
        pos = inputs.positions[at].cpu().numpy()
        self._decode(table, inputs, full, inputs.input_ids[at], pos, at)

    def _decode(
        self,
        table: torch.Tensor,
        inputs: StepInputs,
        rows: np.ndarray,
        token: torch.Tensor,
        pos: np.ndarray,
        at: torch.Tensor,
    ) -> torch.Tensor:
        """One token each for `rows` (batch rows) at positions `pos`, into the slots of
        token indices `at` -> their final hidden states [R, hidden]."""
        device = token.device
        index = torch.from_numpy(rows).to(device)
        positions = torch.from_numpy(pos.astype(np.int64)).to(device)
        return self._forward(
            table,
            token,
            positions,
            inputs.out_slots[at],
            inputs.req_rows[index],
            inputs.req_rows[index],
            positions,
            torch.ones_like(positions),
            torch.arange(len(rows), device=device),
            torch.zeros(len(rows), dtype=torch.bool, device=device),
        )

    def _sample(
        self, hidden: torch.Tensor, inputs: StepInputs, rows: np.ndarray, sample_pos: np.ndarray
    ) -> torch.Tensor:
        """A draft token for each of `rows` from its final hidden state [R, hidden], drawn
        as the target draws at `sample_pos` (the position of the token sampled)."""
        device = hidden.device
        logits = self.model.logits(hidden)
        params = inputs.sampling.rows(torch.from_numpy(rows).to(device))
        positions = torch.from_numpy(sample_pos.astype(np.int64)).to(device)
        return sample(logits, params, positions, cpu_kernel=self.cpu_kernels)

    def _forward(
        self,
        table: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        token_rows: torch.Tensor,
        req_rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        starts: torch.Tensor,
        is_prefill: torch.Tensor,
    ) -> torch.Tensor:
        attention = plan_attention(
            table,
            req_rows,
            prefix_lens,
            extend_lens,
            starts,
            is_prefill,
            out_slots,
            self.backend,
            token_rows,
            positions,
        )
        return self.model(input_ids, positions, attention, self.kv_cache)


def _with_drafts(inputs: StepInputs, ids: torch.Tensor) -> StepInputs:
    """`inputs` with the step's tokens `ids`: their drafts compared with the samples, and
    counted by the penalties of the iterations after them."""
    assert inputs.verify is not None
    host = ids.cpu().numpy()
    adjust = inputs.adjust
    if adjust.penalties is not None:
        adjust = replace(adjust, penalties=adjust.penalties.with_draft_ids(host))
    return replace(inputs, input_ids=ids, verify=inputs.verify.with_ids(host), adjust=adjust)
