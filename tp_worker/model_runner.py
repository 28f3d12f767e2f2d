"""ModelRunner: turns one ForwardBatch into one StepResult (runs in every tp_worker).

It owns the tensors: weights, the KV cache, and the request->slot table on the device. The
controller owns the bookkeeping and tells it, per step, which slots to write and which table
rows to fill. Usable in-process (tests, `tokenmill generate`) as well as inside a worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenmill.protocol.arrays import unpack
from tokenmill.protocol.control import (
    LoadLoraAdapter,
    ReceiveWeights,
    UnloadLoraAdapter,
    WorkerAction,
)
from tokenmill.protocol.step import ForwardBatch, RoutingShape, StepResult
from tokenmill.tp_worker.config import RunnerConfig
from tokenmill.tp_worker.cpu import ops as cpu_ops
from tokenmill.tp_worker.cpu import quantized
from tokenmill.tp_worker.cpu.host_memory import give_memory_back
from tokenmill.tp_worker.cuda import attention as attention_triton
from tokenmill.tp_worker.cuda.memory_profile import (
    CudaMemory,
    DeviceMemory,
    KvBudget,
    profile_kv_budget,
)
from tokenmill.tp_worker.device import cpu_kv_cache_tokens, resolve_device, resolve_dtype
from tokenmill.tp_worker.fed_samples import LastSamples
from tokenmill.tp_worker.model.attention import plan_attention, plan_last_layer
from tokenmill.tp_worker.model.config import ModelConfig, load_model_config
from tokenmill.tp_worker.model.decoder import CausalLM, local_kv_heads
from tokenmill.tp_worker.model.draft import DraftModel
from tokenmill.tp_worker.model.lora_checkpoint import BadAdapter
from tokenmill.tp_worker.model.lora_rows import LoraRows
from tokenmill.tp_worker.model.lora_slots import LoraSlots
from tokenmill.tp_worker.model.parallel import TpGroup
from tokenmill.tp_worker.model.routing_log import RoutingLog
from tokenmill.tp_worker.model.weights import dummy_weights, load_weights
from tokenmill.tp_worker.sample.logprobs import ScoredPositions, default_chunk_size, score_prompt
from tokenmill.tp_worker.sample.penalties import LogitAdjuster
from tokenmill.tp_worker.step_inputs import StepInputs, StepInputsBuilder
from tokenmill.tp_worker.step_outputs import StepOutputs, score_sampled
from tokenmill.tp_worker.weight_update import BadWeights, WeightUpdater

logger = logging.getLogger(__name__)
# NOTE: the prompt positions' final hidden states [P, hidden] and their rows' adapters
PromptStates = tuple[torch.Tensor, LoraRows | None]


class ModelRunner:
    def __init__(self, config: RunnerConfig, memory: DeviceMemory | None = None) -> None:
        """memory: how the KV cache is sized after a profiling step where kv_cache_tokens is
        0 (None: CudaMemory on a GPU; on the CPU, no profiling: a share of free memory)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.group = TpGroup.current()
        self.model_config: ModelConfig = load_model_config(config.model, config.max_model_len)
        self.model = CausalLM(self.model_config, self.group, self.dtype, self.device)
        if config.load_format == "dummy":
            dummy_weights(self.model)
        else:
            load_weights(self.model, Path(config.model))
        self.model.eval()
        # NOTE: before the CPU kernels pack (and free) them: new weights need the shapes back
        self.param_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        # NOTE: decided once: the dense layers and attention run in csrc/ together or not at all.
        self.cpu_kernels = (
            config.cpu_kernels and self.device.type == "cpu" and cpu_ops.supports(self.dtype)
        )
        if self.cpu_kernels:
            self.model.use_cpu_kernels()
            blocks = self.model.block_kernels()
            if blocks:
                logger.info("%s", quantized.summary(blocks))
        else:
            self.model.dequantize_blocks()  # NOTE: a GGUF file's, for torch's products
        # NOTE: loading's and packing's temporaries, which the worker's malloc settings
        # (cpu/host_memory.py) would keep: 1.4 GiB at the start of a 1B Q4_K_M file
        give_memory_back(self.device)
        self.lora_slots = self._lora_slots()
        self.attention_backend = pick_attention_backend(config.attention_backend, self.cpu_kernels)
        if self.attention_backend == "triton":
            self.model.use_triton_kernels()  # NOTE: the Triton backend's dense layers too
        self.drafter = (
            DraftModel(
                config.draft_model,
                self.group,
                self.dtype,
                self.device,
                self.cpu_kernels,
                self.attention_backend,
                dummy=config.load_format == "dummy",
            )
            if config.draft_model
            else None
        )
        # NOTE: allocated before the KV cache is sized from what memory is left.
        self.adjuster = LogitAdjuster(
            config.max_running_requests,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            self.device,
        )
        self.processed_logprobs = config.logprobs_mode == "processed"
        self.last_samples = LastSamples(config.max_running_requests)
        self.step_inputs = StepInputsBuilder(self.device)
        self.time_forward = False  # --step-timing: accumulate forward_s (syncs on CUDA)
        # NOTE: where a batch's grammar masks follow it (GrammarRows.bitmask None): reads
        # them, [G, W] int32, for the step id (the worker's step channel; None in process).
        self.receive_mask: Callable[[int], np.ndarray] | None = None
        self.forward_s = 0.0
        self.prompt_chunk = config.prompt_logprob_chunk or default_chunk_size(
            self.model_config.vocab_size
        )
        self.updater: WeightUpdater | None = None  # the control plane's, made on first use
        self.routing_log = self._routing_log()
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_budget: KvBudget | None = None  # what the profiling step found, where it ran
        # NOTE: every rank must address the same slots: the smallest memory decides.
        self.kv_cache_tokens = config.kv_cache_tokens or self.group.min_over_ranks(
            self._fitting_kv_tokens(memory), self.device
        )
        # NOTE: a row can never hold more tokens than the whole cache.
        self.max_model_len = min(config.max_model_len, self.kv_cache_tokens)
        self.allocate_kv()
        self._allocate_table(config.max_running_requests)

    def _lora_slots(self) -> LoraSlots | None:
        """--enable-lora: the adapter slots, with the adapters given at start in the first."""
        config = self.config
        if not config.max_loras:
            return None
        if len(config.lora_modules) > config.max_loras:
            raise ValueError(
                f"--lora-modules names {len(config.lora_modules)} adapters, more than "
                f"--max-loras {config.max_loras}"
            )
        slots = LoraSlots(self.model, config.max_loras, config.max_lora_rank)
        for slot, path in enumerate(config.lora_modules):
            try:
                slots.load(slot, path)
            except BadAdapter as e:
                raise ValueError(f"--lora-modules {path}: {e}") from e
        return slots

    def _routing_log(self) -> RoutingLog | None:
        """--enable-return-routed-experts: the log the MoE layers fill each forward pass."""
        if not self.config.return_routed_experts:
            return None
        if not self.model_config.moe_layers:
            raise ValueError(
                f"--enable-return-routed-experts: {self.model_config.architecture} has no "
                "mixture of experts to return the routing of"
            )
        return self.model.log_routing()

    @property
    def routing_shape(self) -> RoutingShape | None:
        """What each token's routed experts hold, where the steps return them."""
        if self.routing_log is None:
            return None
        c = self.model_config
        return RoutingShape(c.num_layers, c.moe_layers, c.experts_per_token)

    def allocate_kv(self) -> None:
        """The KV cache (the draft model's too), zeroed. NOTE: head-major: a row's keys of one
        head lie together when its slots do, so attention reads runs of memory rather than a
        head's share of every slot's line."""
        kv_shape = (
            local_kv_heads(self.model_config, self.group),
            self.kv_cache_tokens,
            self.model_config.head_dim,
        )
        self.kv_cache = [
            (
                torch.zeros(kv_shape, dtype=self.dtype, device=self.device),
                torch.zeros(kv_shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.model_config.num_layers)
        ]
        if self.drafter is not None:
            self.drafter.allocate(self.kv_cache_tokens, self.dtype, self.device)

    def _allocate_table(self, rows: int) -> None:
        self.table = torch.zeros(rows, self.max_model_len, dtype=torch.int32, device=self.device)
        # NOTE: the same memory, written through numpy where the table lives on the host
        self.host_table = self.table.numpy() if self.device.type == "cpu" else None

    def _fitting_kv_tokens(self, memory: DeviceMemory | None) -> int:
        """KV slots that fit, at most max_running_requests full rows: on a GPU what
        --gpu-memory-utilization leaves after a profiling step, on the CPU a share of the
        available memory (the profile's peak is torch's CUDA allocator's)."""
        cap = self.config.max_running_requests * self.config.max_model_len
        if memory is None and self.device.type == "cuda":
            memory = CudaMemory(self.device)
        if memory is None:
            return cpu_kv_cache_tokens(self._kv_bytes_per_token(), cap, self.config.cpu_sharers)
        budget = self.kv_budget = self.profile_kv_budget(memory)
        logger.info("KV cache after a profiling step: %s", budget.describe())
        if budget.kv_tokens < budget.profile_tokens:
            raise RuntimeError(
                f"--gpu-memory-utilization {budget.utilization:g} leaves room for "
                f"{budget.kv_tokens} KV tokens, fewer than one --max-prefill-tokens chunk "
                f"({budget.profile_tokens}): {budget.describe()}. Raise it, or lower "
                "--max-prefill-tokens, or give the model more GPUs (--tensor-parallel-size)"
            )
        return min(cap, budget.kv_tokens)

    def profile_kv_budget(self, memory: DeviceMemory) -> KvBudget:
        """The profiling step (cuda/memory_profile.py) over a scratch KV cache of one chunk's
        slots and a one-row table; then the runner holds no cache and its row samples are
        forgotten, as before."""
        tokens = max(1, min(self.config.profile_tokens, self.config.max_model_len))
        self.kv_cache_tokens = self.max_model_len = tokens
        self.allocate_kv()
        self._allocate_table(1)
        try:
            return profile_kv_budget(
                self.step,
                memory,
                tokens,
                self.config.max_logprobs,
                self.config.gpu_memory_utilization,
                self._kv_bytes_per_token(),
                # NOTE: the Triton attention's partials grow with the context up to their cap
                attention_triton.PARTIAL_BYTES if self.attention_backend == "triton" else 0,
            )
        finally:
            self.kv_cache = []
            if self.drafter is not None:
                self.drafter.kv_cache = []
            self.last_samples = LastSamples(self.config.max_running_requests)

    @property
    def row_kernels(self) -> tuple[bool, bool]:
        """Where the log-softmax's row sums run: csrc/ (the CPU kernels), cuda/rowwise.py
        (the Triton backend, on CUDA), else torch."""
        return self.cpu_kernels, self.attention_backend == "triton"

    def carry_out(self, action: WorkerAction) -> None:
        """A control command (protocol/control.py): new weights, memory released or taken
        back, an adapter loaded or unloaded. Raises BadWeights where the caller's weights do
        not fit."""
        if self.updater is None:
            self.updater = WeightUpdater(self)
        match action:
            case ReceiveWeights() if action.lora_name:
                # NOTE: every broadcast first, then the whole adapter checked
                tensors = self.updater.receive_tensors(action)
                self._adapter(lambda s: s.load(action.lora_slot, action.lora_path, tensors))
            case LoadLoraAdapter():
                self._adapter(lambda s: s.load(action.slot, action.lora_path))
            case UnloadLoraAdapter():
                self._adapter(lambda s: s.unload(action.slot))
            case _:
                self.updater.carry_out(action)

    def _adapter(self, change: Callable[[LoraSlots], object]) -> None:
        """An adapter slot's change; BadWeights (a 400) where LoRA is off or it is refused."""
        if self.lora_slots is None:
            raise BadWeights("LoRA is off: start the server with --enable-lora")
        try:
            change(self.lora_slots)
        except BadAdapter as e:
            raise BadWeights(str(e)) from e

    def _kv_bytes_per_token(self) -> int:
        heads = local_kv_heads(self.model_config, self.group)
        per_layer = 2 * heads * self.model_config.head_dim * self.dtype.itemsize
        draft = 0 if self.drafter is None else self.drafter.kv_bytes_per_token(self.dtype.itemsize)
        return per_layer * self.model_config.num_layers + draft

    @torch.inference_mode()
    def step(self, batch: ForwardBatch) -> StepResult:
        batch = self.last_samples.feed(batch)
        inputs = self.step_inputs.build(batch)
        self._fill_table(inputs)
        self.adjuster.begin(inputs.adjust)
        outputs = StepOutputs(inputs)
        if inputs.verify is not None:
            return self._verify(batch, inputs, outputs)
        for i in range(batch.num_steps):
            if i > 0:
                inputs = inputs.next_decode_step(i, outputs.last_ids)
                self.adjuster.count_sampled(inputs.adjust, outputs.last_ids)
            prompt_hidden, logits = self._forward(inputs)
            self._take_routing(outputs)
            if self.drafter is not None:
                self.drafter.follow(self.table, inputs)
            if i == 0 and prompt_hidden is not None:
                outputs.prompt = self._score_prompt(inputs, prompt_hidden)
            bitmask = self._grammar_mask(batch) if i == 0 else None
            keep = inputs.sampled_logprobs  # NOTE: else nothing reads the raw logits again
            adjusted = self.adjuster.adjust(logits, inputs.adjust, i, bitmask, keep)
            outputs.add(
                score_sampled(logits, inputs, adjusted, self.processed_logprobs, *self.row_kernels)
            )
        result = outputs.to_result(batch.step_id)
        self.last_samples.record(batch, result)
        return result

    def _verify(self, batch: ForwardBatch, inputs: StepInputs, outputs: StepOutputs) -> StepResult:
        """A step with drafts: one forward pass over every row's tokens, then a sampling
        iteration for each draft position, each from the logits at that position, exactly as
        plain decoding samples there (a token's numbers do not depend on its chunk). A row
        keeps its drafts up to the first its own sample disagrees with."""
        if self.drafter is not None:
            self._write_table(inputs)
            inputs = self.drafter.propose(self.table, inputs)
        verify = inputs.verify
        assert verify is not None
        prompt_hidden, logits = self._forward(inputs)  # NOTE: [L, V], each row's 1 + drafts
        self._take_routing(outputs)
        if prompt_hidden is not None:
            outputs.prompt = self._score_prompt(inputs, prompt_hidden)
        bitmask = self._grammar_mask(batch)
        groups = 0 if bitmask is None else len(bitmask) // verify.num_iterations
        for i in range(verify.num_iterations):
            if i > 0:
                self.adjuster.count_drafts(inputs.adjust, i)
            at = inputs.verify_iteration(i)
            row_logits = logits[verify.logit_rows[i]]  # NOTE: a copy, [B, V]
            mask = None if bitmask is None else bitmask[i * groups : (i + 1) * groups]
            adjusted = self.adjuster.adjust(row_logits, at.adjust, i, mask, at.sampled_logprobs)
            outputs.add(
                score_sampled(row_logits, at, adjusted, self.processed_logprobs, *self.row_kernels)
            )
        accepted = verify.accepted(outputs.sampled_ids())
        self.adjuster.uncount_rejected(inputs.adjust, accepted)
        if self.drafter is not None:
            self.drafter.complete(self.table, inputs, accepted)
        result = outputs.to_result(batch.step_id, accepted)
        self.last_samples.record(batch, result)
        return result

    def _take_routing(self, outputs: StepOutputs) -> None:
        if self.routing_log is not None:
            outputs.routed.append(self.routing_log.take())

    def _grammar_mask(self, batch: ForwardBatch) -> np.ndarray | None:
        """The constrained rows' bitmask: in the batch, or read now, after the forward pass,
        so that the controller filled it while the model ran."""
        grammar = batch.sampling.grammar
        if grammar is None:
            return None
        if grammar.bitmask is not None:
            return unpack(grammar.bitmask)
        assert self.receive_mask is not None, "a batch whose masks follow needs a channel"
        return self.receive_mask(batch.step_id)

    def _fill_table(self, inputs: StepInputs) -> None:
        if inputs.fill_rows.numel():
            self.table[inputs.fill_rows, inputs.fill_cols] = inputs.fill_slots

    def _write_table(self, inputs: StepInputs) -> None:
        """Each new token's slot into its row's column for its position. NOTE: where the
        table lives in host memory, one numpy assignment over views of the step's tensors
        (torch's index_put and the cast to int32 were ~70 us of a cold decode step)."""
        if self.host_table is None:
            self.table[inputs.token_rows, inputs.positions] = inputs.out_slots.int()
        else:
            rows, positions = inputs.token_rows.numpy(), inputs.positions.numpy()
            self.host_table[rows, positions] = inputs.out_slots.numpy()

    def _forward(self, inputs: StepInputs) -> tuple[PromptStates | None, torch.Tensor]:
        """The final hidden states [P, hidden] of the prompt positions scored, with their
        adapters (None where the step scores none), and the float32 logits [B, V] of each
        row's last position (timed under --step-timing: the model's share of a step)."""
        self._write_table(inputs)
        attention = plan_attention(
            self.table,
            inputs.req_rows,
            inputs.prefix_lens,
            inputs.extend_lens,
            inputs.starts,
            inputs.is_prefill,
            inputs.out_slots,
            self.attention_backend,
            inputs.token_rows,
            inputs.positions,
            # NOTE: the host's token rows only where a backend plans from them
            inputs.host.tokens if inputs.host and self.attention_backend == "triton" else None,
        )
        # NOTE: the last layer computes only the tokens read, where the backend allows it
        # (every token, where each one's experts are returned).
        kept, last = (inputs.last_layer if self.routing_log is None else None), None
        last_plan = plan_last_layer(attention, kept)
        if kept is not None and last_plan is not None:
            last = (last_plan, kept.index)
        else:
            kept = None
        lora = LoraRows.of(inputs.lora_token_slots, self.device)
        started = time.perf_counter()
        hidden = self.model(
            inputs.input_ids, inputs.positions, attention, self.kv_cache, last, lora
        )
        if lora is not None and kept is not None:
            lora = lora.take(kept.index)
        last_index = inputs.last_index if kept is None else kept.last_index
        logits = self.model.logits(
            hidden if last_index is None else hidden[last_index],
            None if lora is None else lora.take(last_index),
        )
        if self.time_forward:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.forward_s += time.perf_counter() - started
        if not inputs.prompt_rows.numel():
            return None, logits  # NOTE: most steps; an empty gather costs a cold torch call
        prompt_index = inputs.prompt_hidden_index if kept is None else kept.prompt_index
        prompt_lora = None if lora is None else lora.take(prompt_index)
        return (hidden[prompt_index], prompt_lora), logits

    def _score_prompt(self, inputs: StepInputs, states: PromptStates) -> ScoredPositions:
        """states: the hidden states [P, hidden] of inputs.prompt_hidden_index and their
        adapters."""
        hidden, lora = states

        def logits(chunk: torch.Tensor, rows: slice) -> torch.Tensor:
            return self.model.logits(chunk, None if lora is None else lora.take(rows))

        return score_prompt(
            hidden,
            inputs.prompt_targets,
            logits,
            inputs.prompt_num_top,
            self.prompt_chunk,
            *self.row_kernels,
        )


def pick_attention_backend(asked: str, cpu_kernels: bool) -> str:
    """auto: our CPU kernel where it runs, else SDPA; triton when asked (and installed)."""
    if asked == "triton":
        if not attention_triton.available():
            raise RuntimeError("--attention-backend triton: Triton is not installed")
        return "triton"
    return "cpu" if cpu_kernels and asked == "auto" else "sdpa"
