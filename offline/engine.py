"""In-process generation, with no server: the real controller (scheduler, prefix cache,
batch builder, output processor) stepping a ModelRunner directly instead of over sockets.

The tests' reference runs, the `tokenmill generate` demo and the benchmarks use it, so what
they check is the same scheduling the server does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from tokenmill.controller.config import ControllerConfig
from tokenmill.controller.controller import Controller
from tokenmill.controller.grammar import GrammarEngine
from tokenmill.protocol.arrays import pack, unpack
from tokenmill.protocol.control import (
    ControlCommand,
    ControlReply,
    WorkerCommand,
    WorkerCommandDone,
)
from tokenmill.protocol.outputs import BatchOutput, RequestOutput
from tokenmill.protocol.requests import (
    Constraint,
    DetokenizeParams,
    FrontendMessage,
    GenerateRequest,
    LogprobParams,
    SamplingParams,
)
from tokenmill.protocol.stats import EngineReport
from tokenmill.protocol.step import ForwardBatch, GrammarMask, StepResult, WorkerReady
from tokenmill.tp_worker.model_runner import ModelRunner
from tokenmill.tp_worker.worker_process import carry_out


@dataclass(frozen=True)
class OfflineRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    num_top: int = 0
    token_ids: tuple[int, ...] = ()
    prompt_logprob_start: int = -1
    """Score prompt tokens from this position (-1 = none); position 0 is never scored."""
    stop_at_eos: bool = False
    logprobs: bool = True
    """The generated tokens' logprobs (OpenAI `logprobs: true`); num_top and token_ids
    ask for them too."""
    constraint: Constraint | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    speculative: bool = True
    """May draft, where the engine speculates."""
    processed: bool = False
    """Its sampled tokens' logprobs describe the distribution sampled from."""
    routed_experts_start: int = -1
    """Return the experts of positions from here (the runner's return_routed_experts);
    -1: not asked."""
    lora_name: str = ""
    """The LoRA adapter it runs with (the runner's max_loras; OfflineEngine's lora names)."""

    def message(self, req_id: str) -> GenerateRequest:
        sampling = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            ignore_eos=not self.stop_at_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
        )
        logprobs = LogprobParams(
            return_logprob=self.logprobs,
            num_top=self.num_top,
            token_ids=self.token_ids,
            prompt_start=self.prompt_logprob_start,
            processed=self.processed,
        )
        return GenerateRequest(
            req_id,
            pack(np.asarray(self.prompt_ids, np.int32)),
            sampling,
            logprobs,
            DetokenizeParams(),
            constraint=self.constraint,
            speculative=self.speculative,
            routed_experts_start=self.routed_experts_start,
            lora_name=self.lora_name,
        )


@dataclass
class OfflineOutput:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)  # per token [num_top] int32
    top_logprobs: list[np.ndarray] = field(default_factory=list)
    token_ids_logprobs: list[np.ndarray] = field(default_factory=list)  # per token [M]
    prompt_logprobs: list[float] = field(default_factory=list)  # from max(start, 1)
    prompt_top_ids: list[np.ndarray] = field(default_factory=list)
    prompt_top_logprobs: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None
    # [N, num_layers, k] int16, with the last output where asked (-1 in dense layers)
    routed_experts: np.ndarray | None = None

    def add(self, out: RequestOutput) -> None:
        self.output_ids += unpack(out.new_ids).tolist()
        if out.logprobs is not None:
            self.logprobs += unpack(out.logprobs).tolist()
        if out.top_ids is not None and out.top_logprobs is not None:
            self.top_ids += list(unpack(out.top_ids))
            self.top_logprobs += list(unpack(out.top_logprobs))
        if out.token_ids_logprobs is not None:
            self.token_ids_logprobs += list(unpack(out.token_ids_logprobs))
        if out.prompt is not None:
            self.prompt_logprobs += unpack(out.prompt.logprobs).tolist()
            self.prompt_top_ids += list(unpack(out.prompt.top_ids))
            self.prompt_top_logprobs += list(unpack(out.prompt.top_logprobs))
        if out.routed_experts is not None:
            self.routed_experts = unpack(out.routed_experts)
        self.finish_reason = out.finish_reason


class LocalSockets:
    """The controller's sockets, in one process: a step goes straight to `step` (a
    ModelRunner's, or a test's fake model)."""

    def __init__(
        self,
        step: Callable[[ForwardBatch], StepResult],
        command: Callable[[WorkerCommand], WorkerCommandDone] | None = None,
    ) -> None:
        self.step = step
        self.command = command
        self.replies: list[ControlReply] = []
        self.inbox: deque[FrontendMessage] = deque()
        self.outputs: list[RequestOutput] = []
        self._results: deque[StepResult] = deque()  # NOTE: computed at once, read in order
        self._waiting: ForwardBatch | None = None  # a batch whose grammar masks follow

    def receive_requests(self, timeout_ms: int) -> list[FrontendMessage]:
        messages = list(self.inbox)
        self.inbox.clear()
        return messages

    def send_batch(self, batch: ForwardBatch | WorkerCommand) -> None:
        if isinstance(batch, WorkerCommand):
            assert self.command is not None, "this engine's ranks take no commands"
            self._results.append(self.command(batch))  # type: ignore[arg-type]
            return
        grammar = batch.sampling.grammar
        if grammar is not None and grammar.bitmask is None:
            self._waiting = batch  # NOTE: run once its masks come (send_mask)
            return
        self._results.append(self.step(batch))

    def send_mask(self, mask: GrammarMask) -> None:
        batch = self._waiting
        assert batch is not None and batch.step_id == mask.step_id, "masks for no batch"
        self._waiting = None
        grammar = msgspec.structs.replace(batch.sampling.grammar, bitmask=mask.bitmask)
        sampling = msgspec.structs.replace(batch.sampling, grammar=grammar)
        self._results.append(self.step(msgspec.structs.replace(batch, sampling=sampling)))

    def receive_result(self) -> StepResult:
        assert self._results, "no step was sent"
        return self._results.popleft()

    def send_outputs(self, batch: BatchOutput) -> None:
        self.outputs += batch.outputs

    def send_report(self, report: EngineReport | ControlReply) -> None:
        if isinstance(report, ControlReply):
            self.replies.append(report)


class OfflineEngine:
    def __init__(
        self,
        runner: ModelRunner,
        max_prefill_tokens: int = 4096,
        decode_steps: int = 1,
        enable_prefix_cache: bool = True,
        grammar: GrammarEngine | None = None,
        speculative_config: str = "",
        lora_names: tuple[str, ...] = (),
    ) -> None:
        """lora_names: the names of the runner's lora_modules (default: their paths)."""
        self.runner = runner
        self.sockets = LocalSockets(runner.step, lambda command: carry_out(runner, command))
        modules = runner.config.lora_modules
        names = lora_names or modules
        config = ControllerConfig(
            "",
            (),
            "",
            "",
            "",
            max_running_requests=runner.config.max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            decode_steps=decode_steps,
            enable_prefix_cache=enable_prefix_cache,
            speculative_config=speculative_config,
            report_interval_s=3600.0,
            max_loras=runner.config.max_loras,
            lora_modules=tuple(zip(names, modules, strict=True)),
        )
        ready = WorkerReady(
            runner.kv_cache_tokens,
            runner.max_model_len,
            runner.model_config.eos_token_ids,
            runner.routing_shape,
        )
        self.controller = Controller(config, ready, self.sockets, grammar)  # type: ignore[arg-type]
        self.num_requests = 0

    def generate(self, requests: list[OfflineRequest]) -> list[OfflineOutput]:
        """Runs the requests together, like a server receiving them at once."""
        ids = [f"offline-{self.num_requests + i}" for i in range(len(requests))]
        self.num_requests += len(requests)
        self.sockets.inbox.extend(r.message(i) for r, i in zip(requests, ids, strict=True))
        outputs = {i: OfflineOutput() for i in ids}
        while self.sockets.inbox or self.controller.has_work():
            self.controller.run_once()
            for out in self.sockets.outputs:
                outputs[out.req_id].add(out)
            self.sockets.outputs.clear()
        self.controller.kv.check_integrity([])
        return [outputs[i] for i in ids]

    def control(self, make: Callable[[str], ControlCommand]) -> ControlReply:
        """A control command (protocol/control.py) carried out between steps, as a server's
        controller does: its reply."""
        self.num_requests += 1
        self.sockets.inbox.append(make(f"ctl-{self.num_requests}"))
        self.controller.run_once()
        return self.sockets.replies.pop()
