"""Configuration of the tp_worker processes: which checkpoint, where, how much cache, which
rank. Plain dataclasses (no torch), so the launcher can build them without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerConfig:
    model: str
    """Directory of a Hugging Face checkpoint (config.json, *.safetensors)."""
    kv_cache_tokens: int = 0
    """KV slots per layer, addressed 0..kv_cache_tokens-1 (0 = what free memory allows, at
    most max_running_requests * max_model_len)."""
    gpu_memory_utilization: float = 0.9
    """With kv_cache_tokens 0 on a GPU: the share of the device's memory this rank may use
    (cuda/memory_profile.py sizes the KV cache after a profiling step)."""
    profile_tokens: int = 2048
    """The profiling step's prefill: the largest chunk a step takes (--max-prefill-tokens)."""
    max_logprobs: int = 20
    """Top logprobs the profiling step scores at each prompt position (--max-logprobs)."""
    max_running_requests: int = 64
    """Rows of the request->slot table: requests that can hold KV at once."""
    max_model_len: int = 4096
    """Longest sequence (prompt + output) a row of the table can hold."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    prompt_logprob_chunk: int = 0
    """Prompt positions scored per lm_head chunk; 0 = as many as fit 64 MiB of logits."""
    cpu_kernels: bool = True
    """On the CPU, run the dense layers and attention through csrc/ (in float32 and
    bfloat16); False takes the torch path (torch ops, SDPA) that devices without kernels of
    ours take, so that tests can check it on the CPU."""
    cpu_sharers: int = 1
    """Ranks on this machine, of every engine replica here: on the CPU they share its cores
    (threads each) and its memory (with kv_cache_tokens 0, each takes its part of the KV
    share)."""
    attention_backend: str = "auto"
    """auto (our CPU kernel on the CPU, SDPA elsewhere), sdpa, or triton (paged, for CUDA)."""
    load_format: str = "auto"
    """auto: the checkpoint's safetensors; dummy: random weights from config.json alone."""
    draft_model: str = ""
    """Speculative decoding's draft model (a checkpoint directory with the target's
    tokenizer): the drafts of a verifying step are placeholders it fills. Empty: none."""
    logprobs_mode: str = "raw"
    """raw: generated tokens' logprobs are the log-softmax of the model's logits; processed:
    of the distribution sampled from (after stop ban, bias, penalties, temperature, filters)."""
    return_routed_experts: bool = False
    """Each step's result carries the experts every token it computed was routed to
    (--enable-return-routed-experts; a mixture-of-experts model only)."""
    max_loras: int = 0
    """--enable-lora: adapter slots, LoRA adapters held at once (--max-loras); 0: LoRA off."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have (--max-lora-rank)."""
    lora_modules: tuple[str, ...] = ()
    """The adapters loaded at start (PEFT directories), into slots 0, 1, ... in order."""


@dataclass(frozen=True)
class WorkerConfig:
    runner: RunnerConfig
    rank: int
    world_size: int
    dist_init_addr: str
    """torch.distributed init method, e.g. tcp://127.0.0.1:29500 (unused with one rank)."""
    batch_addr: str
    """Address the controller pushes this rank's ForwardBatch messages to (we connect):
    unix:// on the controller's node, tcp:// from another."""
    result_addr: str
    """The controller's result input, unix:// (rank 0 is on its node; rank 0 connects)."""
    parent_pid: int | None = None
    step_timing: bool = False
    """Time each step and its model forward, and send the figures with the result."""
    local_rank: int = -1
    """This process's index among the ranks on its node, of every engine replica there
    (-1: rank): which GPU it takes."""
    cluster_key_file: str = ""
    """The CURVE keys for a tcp:// batch_addr (a rank on another node than the controller)."""
    dist_timeout_s: float = 300.0
    """How long the rendezvous waits for every rank."""
