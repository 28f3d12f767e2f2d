"""The adapter slots of one rank's model (tp_worker, --enable-lora): ProjectionLora on every
projection an adapter may touch, and an adapter put into a slot, or taken out, whole."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.tp_worker.model.decoder import CausalLM, DecoderLayer
from tokenmill.tp_worker.model.lora import EmbeddingLora, ProjectionLora
from tokenmill.tp_worker.model.lora_checkpoint import BadAdapter, read_adapter
from tokenmill.tp_worker.model.parallel import ShardedLinear

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoraSlots:
    def __init__(self, model: CausalLM, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.projections: dict[tuple[int, str], ProjectionLora] = {}
        for index, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            for name in PROJECTIONS:
                proj = getattr(layer, name)
                if isinstance(proj, ShardedLinear):
                    reduce = proj.row_parallel and model.group.size > 1
                    proj.lora = ProjectionLora(max_loras, reduce, 3 * max_rank)
                    self.projections[(index, name.removesuffix("_proj"))] = proj.lora
        model.embed_lora = EmbeddingLora(max_loras)
        model.lm_head_lora = ProjectionLora(max_loras)
        if model.layer_stack is not None:  # NOTE: csrc/layer_stack.cpp adds the deltas too
            model.layer_stack.point_at_lora()

    def load(self, slot: int, path: str, tensors: dict[str, torch.Tensor] | None = None) -> int:
        """The adapter at `path` into `slot` (whatever it held before goes), all or nothing:
        read and checked whole before any projection takes it (`tensors`: its weights as a
        trainer sent them, path's adapter_config.json their settings). Returns its rank."""
        self._check_slot(slot)
        adapter = read_adapter(Path(path), self.model, self.max_rank, tensors)
        for key, lora in self.projections.items():
            lora.set(slot, adapter.projections.get(key))
        assert self.model.embed_lora is not None and self.model.lm_head_lora is not None
        self.model.embed_lora.set(slot, adapter.embed)
        self.model.lm_head_lora.set(slot, adapter.lm_head)
        return adapter.rank

    def unload(self, slot: int) -> None:
        self._check_slot(slot)
        for lora in self.projections.values():
            lora.set(slot, None)
        assert self.model.embed_lora is not None and self.model.lm_head_lora is not None
        self.model.embed_lora.set(slot, None)
        self.model.lm_head_lora.set(slot, None)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise BadAdapter(f"adapter slot {slot} is outside 0..{self.max_loras - 1}")
