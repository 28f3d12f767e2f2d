"""Adapters loaded, replaced and unloaded at run time (controller process, --enable-lora):
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, carried out between two steps
(controller/control.py runs them as it runs every command).

A new adapter takes a free slot; load_inplace replaces an adapter's weights in its slot:
its running requests go back to the queue first (recomputed with the new weights, keeping
the tokens they had) and the prefixes its old weights computed are dropped. Unloading an
adapter that requests still use is refused (409): nothing is cut short, nothing leaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from tokenmill.controller.lora_registry import Adapter, LoraRegistry
from tokenmill.controller.refused import Refused
from tokenmill.protocol.control import LoadLoraAdapter, ReceiveWeights, UnloadLoraAdapter

if TYPE_CHECKING:
    from tokenmill.controller.control import ControlPlane


def carry_out(plane: ControlPlane, command: LoadLoraAdapter | UnloadLoraAdapter) -> str:
    registry = plane.controller.lora
    if registry is None:
        raise Refused(400, "LoRA is off: start the server with --enable-lora")
    if isinstance(command, UnloadLoraAdapter):
        return _unload(plane, registry, command)
    known = registry.get(command.lora_name)
    if known is None:
        return _load(plane, registry, command)
    if not command.load_inplace:
        raise Refused(
            400,
            f"the LoRA adapter `{command.lora_name}` is already loaded (load_inplace: true "
            "replaces its weights)",
        )
    return _replace(plane, registry, command)


def _load(plane: ControlPlane, registry: LoraRegistry, command: LoadLoraAdapter) -> str:
    slot = registry.free_slot()
    if slot is None:
        names = ", ".join(sorted(registry.adapters))
        raise Refused(
            400, f"--max-loras {registry.max_loras} adapters are loaded ({names}): unload one"
        )
    plane.run_on_ranks(msgspec.structs.replace(command, slot=slot))
    registry.add(command.lora_name, command.lora_path, slot)
    return f"Success: LoRA adapter '{command.lora_name}' added successfully."


def _replace(plane: ControlPlane, registry: LoraRegistry, command: LoadLoraAdapter) -> str:
    old = registry.adapters[command.lora_name]
    return _swap(
        plane, registry, old, command.lora_path, msgspec.structs.replace(command, slot=old.slot)
    )


def from_trainer(plane: ControlPlane, command: ReceiveWeights) -> str:
    """An adapter's new weights broadcast by the trainer (the RL control plane's
    /update_weights_from_distributed with lora_name): as load_inplace, from its tensors."""
    registry = plane.controller.lora
    if registry is None:
        raise Refused(400, "LoRA is off: start the server with --enable-lora")
    old = registry.get(command.lora_name)
    if old is None:
        raise Refused(404, f"The lora adapter '{command.lora_name}' cannot be found.")
    action = msgspec.structs.replace(command, lora_slot=old.slot, lora_path=old.path)
    return _swap(plane, registry, old, old.path, action)


def _swap(
    plane: ControlPlane,
    registry: LoraRegistry,
    old: Adapter,
    path: str,
    action: LoadLoraAdapter | ReceiveWeights,
) -> str:
    """New weights for the loaded adapter `old` through `action` on the ranks: its running
    requests back to the queue first, a new cache space, the old one's prefixes dropped."""
    controller, name = plane.controller, old.name
    plane.num_retracted = controller.scheduler.retract_where(lambda r: r.cache_space == old.space)
    # NOTE: on a refusal the ranks keep the old weights (each loads all or nothing)
    plane.run_on_ranks(action)
    adapter, old_space = registry.replace(name, path)
    for request in controller.requests.values():
        if request.cache_space == old_space:
            request.cache_space = adapter.space
    if controller.kv.cache is not None:
        controller.kv.cache.drop_space(old_space)
    return f"Success: LoRA adapter '{name}' replaced (version {adapter.version})."


def _unload(plane: ControlPlane, registry: LoraRegistry, command: UnloadLoraAdapter) -> str:
    controller, name = plane.controller, command.lora_name
    adapter = registry.get(name)
    if adapter is None:
        raise Refused(404, f"The lora adapter '{name}' cannot be found.")
    users = sum(r.cache_space == adapter.space for r in controller.requests.values())
    if users:
        raise Refused(
            409, f"{users} requests use the LoRA adapter `{name}`: wait for them or abort them"
        )
    plane.run_on_ranks(msgspec.structs.replace(command, slot=adapter.slot))
    registry.remove(name)
    if controller.kv.cache is not None:
        controller.kv.cache.drop_space(adapter.space)
    return f"Success: LoRA adapter '{name}' removed successfully."
