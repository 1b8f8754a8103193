"""`tandem rollout`: serve a model for rollouts over HTTP (FastAPI + uvicorn), with versioned weight sync.

Parses and checks the flags first (a non-loopback bind without a key is refused before anything
loads), binds the port (a busy one is an error at once), notices an unreachable hub in seconds, imports
torch and the backend after, listens once the model is served, then prints one line with the address.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from tandemrl.cli import frozen_heap
from tandemrl.cli.args import ArgumentParser, add_config_args, build_config, check_known, load_yaml
from tandemrl.cli.inputs import check_cached, go_offline_if_unreachable, is_hub_model
from tandemrl.generation.base import EngineConfig
from tandemrl.server.config import RolloutServerConfig


def main(argv: list[str]) -> int:
    config, engine = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    sock = _bind(config.host, config.port)  # a busy port is said now, not after the model loaded
    if is_hub_model(engine.model):  # before transformers is imported: it reads HF_HUB_OFFLINE once
        go_offline_if_unreachable()
        check_cached(engine.model)
    serve(config, engine, sock)
    return 0


def parse(argv: list[str]) -> tuple[RolloutServerConfig, EngineConfig]:
    """The server's leaf and the engine's (the same engine leaf `tandem train` has): yaml < flags."""
    parser = ArgumentParser(prog="tandem rollout", usage="tandem rollout --model MODEL [--FLAG VALUE ...]", description="Serve a model for rollouts over HTTP, with versioned weight sync.")
    parser.add_argument("--config", metavar="YAML", help="YAML file of flag defaults; flags override it")
    add_config_args(parser, RolloutServerConfig, title="Server")
    add_config_args(parser, EngineConfig, title="Model and engine")
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config", None)
    values: dict[str, Any] = {**(load_yaml(config_path) if config_path else {})}
    check_known(values, [RolloutServerConfig, EngineConfig], config_path or "", command="rollout")
    values.update(args)
    config, engine = build_config(RolloutServerConfig, values), build_config(EngineConfig, values)
    if engine.tensor_parallel_size > 1 and config.backend != "engine":
        raise ValueError("--tensor_parallel_size > 1 needs --backend engine (the hf backend runs on one device)")
    return config, engine


def serve(config: RolloutServerConfig, engine: EngineConfig, sock: socket.socket | None = None) -> None:
    """Loads the model and serves it on `sock` (bound, not yet listening: default, bound here)."""
    import uvicorn

    from tandemrl.server.build import build_server

    sock = sock or _bind(config.host, config.port)
    model, tokenizer = _built_in(engine)
    heartbeat_s = 0.0 if sys.stdout.isatty() else 30.0
    app = build_server(config, engine, heartbeat_s=heartbeat_s, model=model, tokenizer=tokenizer, on_rank_death=_rank_died)
    sock.listen(2048)  # only now: until the model is served, a client's connection is refused (it retries), not left hanging
    host, port = sock.getsockname()[:2]
    generator = getattr(app.state, "generator", config.backend)
    print(f"tandem rollout: serving {engine.model} (generator: {generator}) on http://{_url_host(host)}:{port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30, access_log=False))
    with frozen_heap():
        server.run(sockets=[sock])


def _built_in(engine: EngineConfig) -> tuple[Any, Any]:
    """(model, tokenizer) of `--model tandem:tiny`, built in code as `tandem train` builds it (seed 0), so a
    server can be tried offline and trained against; (None, None) for any other model, which is loaded."""
    from tandemrl.tasks.synthetic import TINY_MODEL

    if engine.model != TINY_MODEL:
        return None, None
    from tandemrl.generation.loading import resolve_device
    from tandemrl.tasks.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    return build_model(tokenizer, seed=0).to(resolve_device(engine.device)), tokenizer


def _rank_died(rank: int, exit_code: int | None) -> None:
    """A tensor-parallel rank exited: the model misses a shard and cannot generate, so the server stops."""
    print(f"tandem rollout: tensor-parallel rank {rank} exited (code {exit_code}); stopping the server", file=sys.stderr, flush=True)
    os._exit(1)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # the protocol named: asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        raise ValueError(f"cannot bind {host}:{port} ({error.strerror}); pick another --port or --host") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
