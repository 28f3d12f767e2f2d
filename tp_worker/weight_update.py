"""New weights in a running worker, and its memory given back and taken again (tp_worker).

The served checkpoint's tensors (names, shapes, dtypes from its safetensors headers) are the
contract: new weights, from a checkpoint on disk or broadcast by a trainer, must match them
tensor for tensor, checked before any weight changes, and every rank must agree (a
collective over the tensor-parallel group) before any copies a byte: all or nothing. A
weight the CPU kernels hold in packed panels is unpacked for the copy and packed again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from tokenmill.protocol.control import (
    JoinWeightsGroup,
    LeaveWeightsGroup,
    LoadWeights,
    ReceiveWeights,
    ReleaseMemory,
    ResumeMemory,
    WorkerAction,
)
from tokenmill.tp_worker.cpu.host_memory import give_memory_back
from tokenmill.tp_worker.cpu.quantized import LAYOUTS
from tokenmill.tp_worker.model.decoder import CausalLM
from tokenmill.tp_worker.model.weights import (
    checkpoint_files,
    dummy_weights,
    gguf_block_types,
    load_tensor,
    load_weights,
)

if TYPE_CHECKING:
    from tokenmill.tp_worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# safetensors' dtype codes -> torch's names (what a trainer sends in `dtypes`)
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
GROUP_TIMEOUT = timedelta(seconds=120)

Manifest = dict[str, tuple[tuple[int, ...], str]]


class BadWeights(ValueError):
    """New weights that do not fit the served checkpoint (the caller's mistake: a 400)."""


def read_manifest(model_dir: Path) -> Manifest:
    """Every tensor of a checkpoint: name -> (shape, dtype name), from the headers alone."""
    manifest: Manifest = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = f.get_slice(name)
                dtype = part.get_dtype()
                manifest[name] = (tuple(part.get_shape()), _DTYPES.get(dtype, dtype.lower()))
    # NOTE: a GGUF file's blocks stand for the float32 weights they dequantize to: new
    # weights come as those (and are served as float weights from then on)
    for name, qtype in gguf_block_types(model_dir).items():
        (rows, row_bytes), _ = manifest[name]
        manifest[name] = ((rows, LAYOUTS[qtype].width(row_bytes)), "float32")
    return manifest


def check_fits(served: Manifest, new: Manifest, where: str) -> None:
    """BadWeights naming the first tensor that is missing or has another shape or dtype."""
    missing = sorted(set(served) - set(new))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise BadWeights(f"{where} lacks tensor {missing[0]!r}{more}")
    for name in sorted(new):
        if name not in served:
            continue  # NOTE: as at start, a tensor the model has no place for is left out
        (shape, dtype), (want_shape, want_dtype) = new[name], served[name]
        if shape != want_shape:
            raise BadWeights(
                f"{where}: tensor {name!r} has shape {list(shape)}, the served model's "
                f"{list(want_shape)}"
            )
        if dtype != want_dtype:
            raise BadWeights(
                f"{where}: tensor {name!r} is {dtype}, the served model's is {want_dtype}"
            )


class WeightUpdater:
    """A rank's side of the control plane (protocol/control.py's WorkerAction)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model: CausalLM = runner.model
        self.served = read_manifest(Path(runner.config.model))
        self.trainer: TrainerLink | None = None

    def carry_out(self, action: WorkerAction) -> None:
        """Raises BadWeights (a 400) or any other error (a 500); every rank raises alike."""
        match action:
            case LoadWeights():
                self.from_disk(Path(action.model_path))
            case JoinWeightsGroup():
                self.join(action)
            case ReceiveWeights():
                self.receive(action)
            case LeaveWeightsGroup():
                self.leave()
            case ReleaseMemory():
                self.release(action.tags)
            case ResumeMemory():
                self.resume(action.tags, Path(action.model_path))

    def from_disk(self, path: Path) -> None:
        try:
            new = read_manifest(path)
            check_fits(self.served, new, f"checkpoint {path}")
            problem = ""
        except (OSError, ValueError) as e:
            problem = str(e) if isinstance(e, BadWeights) else f"checkpoint {path}: {e}"
        self._agree(problem)
        self.rewrite(lambda model: load_weights(model, path))

    def join(self, action: JoinWeightsGroup) -> None:
        if self.trainer is not None:
            raise BadWeights(f"already in weights group {self.trainer.name!r}; destroy it first")
        if action.backend not in ("", "gloo", "nccl"):
            raise BadWeights(f"backend {action.backend!r}: use gloo (CPU) or nccl (CUDA)")
        self.trainer = TrainerLink(action, self.runner.group.rank, self.runner.device)

    def receive(self, action: ReceiveWeights) -> None:
        trainer = self.trainer
        if trainer is None:
            raise BadWeights("no weights group: POST /init_weights_update_group first")
        problem = ""
        try:
            self._check_names(action)
        except BadWeights as e:
            problem = str(e)
        self._agree(problem)

        def copy_all(model: CausalLM) -> None:
            for name, dtype, shape in zip(action.names, action.dtypes, action.shapes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=trainer.device)
                trainer.broadcast(tensor)
                load_tensor(model, name, tensor)

        self.rewrite(copy_all)

    def receive_tensors(self, action: ReceiveWeights) -> dict[str, torch.Tensor]:
        """Every tensor the trainer broadcasts, by name, on the CPU, unchecked (a LoRA
        adapter's: model/lora_checkpoint.py checks them whole, after the last one came)."""
        trainer = self.trainer
        if trainer is None:
            raise BadWeights("no weights group: POST /init_weights_update_group first")
        if action.group_name and action.group_name != trainer.name:
            raise BadWeights(f"group {action.group_name!r}: this server is in {trainer.name!r}")
        if not len(action.names) == len(action.dtypes) == len(action.shapes):
            raise BadWeights("names, dtypes and shapes must have the same length")
        for name, dtype in zip(action.names, action.dtypes, strict=True):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise BadWeights(f"tensor {name!r}: dtype {dtype!r} is not a torch dtype")
        received = {}
        for name, dtype, shape in zip(action.names, action.dtypes, action.shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=trainer.device)
            trainer.broadcast(tensor)
            received[name] = tensor.cpu()
        return received

    def _check_names(self, action: ReceiveWeights) -> None:
        """The announced tensors are the served model's, each with its shape and dtype (a
        trainer may send a subset of them)."""
        trainer = self.trainer
        assert trainer is not None
        if action.group_name and action.group_name != trainer.name:
            raise BadWeights(f"group {action.group_name!r}: this server is in {trainer.name!r}")
        if not len(action.names) == len(action.dtypes) == len(action.shapes):
            raise BadWeights("names, dtypes and shapes must have the same length")
        new = {n: (tuple(s), d) for n, s, d in zip(action.names, action.shapes, action.dtypes)}  # noqa: B905
        unknown = sorted(set(new) - set(self.served))
        if unknown:
            raise BadWeights(f"tensor {unknown[0]!r} is not a tensor of the served model")
        check_fits({n: self.served[n] for n in new}, new, "the trainer's tensors")

    def leave(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None

    def rewrite(self, fill: Callable[[CausalLM], None]) -> None:
        """`fill` writes every weight it brings into the model's parameters, each at its full
        shape again (the CPU kernels' packed panels dropped first, packed anew after)."""
        model = self.model
        model.drop_cpu_kernels()
        for name, param in model.named_parameters():
            shape = self.runner.param_shapes[name]
            if tuple(param.shape) != shape:
                param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
        fill(model)
        if self.runner.cpu_kernels:
            model.use_cpu_kernels()

    def release(self, tags: tuple[str, ...]) -> None:
        """Frees the KV cache and / or the weights (their memory back to the system)."""
        runner = self.runner
        if "kv_cache" in tags:
            runner.kv_cache = []
            if runner.drafter is not None:
                runner.drafter.kv_cache = []
        if "weights" in tags:
            self.model.drop_cpu_kernels()
            for param in self.model.parameters():
                param.data = param.data.new_empty(0)
        give_memory_back(runner.device)

    def resume(self, tags: tuple[str, ...], model_path: Path) -> None:
        """Takes the memory again: a zeroed KV cache; the weights of `model_path` (the last
        checkpoint loaded; random ones again for --load-format dummy)."""
        if "weights" in tags:
            if self.runner.config.load_format == "dummy":
                self.rewrite(dummy_weights)
            else:
                self.rewrite(lambda model: load_weights(model, model_path))
        if "kv_cache" in tags and not self.runner.kv_cache:
            self.runner.allocate_kv()

    def _agree(self, problem: str) -> None:
        """Raises BadWeights on every rank if any rank found a problem (its own message,
        or the other ranks')."""
        ok = self.runner.group.min_over_ranks(0 if problem else 1, self.runner.device)
        if problem:
            raise BadWeights(problem)
        if not ok:
            raise BadWeights("another rank found the new weights do not fit (see its log)")


class TrainerLink:
    """This rank in a torch.distributed group of its own with a trainer: not the default
    group (the ranks' own, for tensor parallelism), so both live side by side."""

    def __init__(self, action: JoinWeightsGroup, tp_rank: int, device: torch.device) -> None:
        self.name = action.group_name
        self.device = device
        rank = action.rank_offset + tp_rank
        if not 0 < rank < action.world_size:
            raise BadWeights(
                f"rank_offset {action.rank_offset} + rank {tp_rank} is outside 1.."
                f"{action.world_size - 1} (the trainer is rank 0)"
            )
        self.store = dist.TCPStore(
            action.master_address,
            action.master_port,
            action.world_size,
            is_master=False,
            timeout=GROUP_TIMEOUT,
        )
        prefixed = dist.PrefixStore(action.group_name, self.store)
        self.group: Any
        backend = action.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            self.group = dist.ProcessGroupNCCL(prefixed, rank, action.world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, action.world_size, GROUP_TIMEOUT)
        logger.info("joined weights group %r as rank %d of %d", self.name, rank, action.world_size)

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        del self.group
        del self.store
