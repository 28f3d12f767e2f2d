"""A trainer's side of `/update_weights_from_distributed` (runs in the trainer's process).

The trainer is rank 0 of a torch.distributed group of its own with the server's ranks (they
join as ranks 1..N through `/init_weights_update_group`); new weights are broadcast from it,
tensor by tensor, in the order the update request names them, under their Hugging Face
names. Both sides wait for each other, so each call runs the HTTP request beside the
collective it pairs with.

    sync = WeightSync.connect("http://127.0.0.1:8000", master_port=29600, num_ranks=1)
    sync.update({name: tensor, ...}, weight_version="step-1")
    sync.close()
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_GROUP = "weight_update_group"


class WeightSyncError(RuntimeError):
    """The server refused or failed a request: its status and message."""


def post(base_url: str, path: str, body: dict[str, Any], api_key: str | None = None) -> dict:
    """A JSON POST to the server; WeightSyncError on anything but 200."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        base_url + path, data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise WeightSyncError(f"{path}: {e.code} {e.read().decode(errors='replace')}") from None


class WeightSync:
    def __init__(
        self,
        base_url: str,
        group: Any,
        store: Any,
        group_name: str,
        api_key: str | None,
    ) -> None:
        self.base_url = base_url
        self.group = group
        self.store = store
        self.group_name = group_name
        self.api_key = api_key

    @staticmethod
    def connect(
        base_url: str,
        master_port: int,
        num_ranks: int,
        master_address: str = "127.0.0.1",
        group_name: str = DEFAULT_GROUP,
        backend: str = "gloo",
        api_key: str | None = None,
        timeout_s: float = 120.0,
    ) -> WeightSync:
        """Makes the group (this process rank 0, the server's `num_ranks` ranks after it)."""
        world = num_ranks + 1
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": group_name,
            "backend": backend,
        }
        answer: dict[str, Any] = {}
        thread = _in_thread(
            answer, lambda: post(base_url, "/init_weights_update_group", body, api_key)
        )
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world, is_master=True, timeout=timeout)
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            group: Any = dist.ProcessGroupNCCL(prefixed, 0, world, options)
        else:
            group = dist.ProcessGroupGloo(prefixed, 0, world, timeout)
        _join(thread, answer)
        return WeightSync(base_url, group, store, group_name, api_key)

    def update(
        self,
        tensors: Mapping[str, torch.Tensor],
        weight_version: str | None = None,
        lora_name: str | None = None,
    ) -> dict[str, Any]:
        """Sends `tensors` (Hugging Face names, full shapes) to every rank of the server;
        the server's answer. lora_name: they are that loaded LoRA adapter's new weights, the
        whole adapter by PEFT's names (--enable-lora)."""
        body: dict[str, Any] = {
            "names": list(tensors),
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "group_name": self.group_name,
            "weight_version": weight_version,
        }
        if lora_name is not None:
            body["lora_name"] = lora_name
        answer: dict[str, Any] = {}
        thread = _in_thread(
            answer,
            lambda: post(self.base_url, "/update_weights_from_distributed", body, self.api_key),
        )
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors.values():
            self.group.broadcast([tensor.contiguous()], options).wait()
        return _join(thread, answer)

    def close(self) -> None:
        post(self.base_url, "/destroy_weights_update_group", {"group_name": self.group_name},
             self.api_key)  # fmt: skip
        del self.group
        del self.store


def _in_thread(answer: dict[str, Any], call: Any) -> threading.Thread:
    def run() -> None:
        try:
            answer["reply"] = call()
        except Exception as e:  # NOTE: re-raised by _join, in the caller's thread
            answer["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _join(thread: threading.Thread, answer: dict[str, Any]) -> dict[str, Any]:
    thread.join()
    if "error" in answer:
        raise answer["error"]
    return answer["reply"]
