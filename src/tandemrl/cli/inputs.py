"""Checks of `tandem train`'s (and `tandem rollout`'s) inputs before anything heavy loads: no model, or a data file that does not
exist, is an error at once (not after the model loaded), and a hub that cannot be reached switches to
offline mode in seconds (instead of a minute of download retries), with a one-line fix when a hub
model is not in the local cache.

Runs before transformers, datasets or huggingface_hub are imported: they read HF_HUB_OFFLINE once.
"""

from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlparse

from tandemrl.config import TrainConfig
from tandemrl.data.load import FILE_SUFFIXES
from tandemrl.tasks.synthetic import TINY_MODEL

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 3.0


def check_inputs(config: TrainConfig) -> None:
    _check_sinks(config.log.report_to)
    model, dataset = config.run.model, config.data.dataset
    if not model:
        raise ValueError(
            "no model given; pass --model with a Hugging Face id or a local directory, or --model tandem:tiny "
            "(a tiny model built in code, nothing downloaded)"
        )
    if dataset and _looks_like_file(dataset) and not os.path.exists(os.path.expanduser(dataset)):
        raise FileNotFoundError(
            f"dataset {dataset!r} does not exist; pass an existing .jsonl/.json/.parquet/.csv file, a directory (saved "
            "with datasets.save_to_disk, or of data files), or a hub id"
        )
    hub_model = is_hub_model(model)
    hub_data = (bool(dataset) and not _looks_like_file(dataset) and not os.path.isdir(os.path.expanduser(dataset))) or (
        not dataset and config.run.task not in ("", "synthetic")
    )
    if not (hub_model or hub_data):
        return
    go_offline_if_unreachable()
    if hub_model:
        check_cached(model)


def is_hub_model(model: str) -> bool:
    return model != TINY_MODEL and not os.path.isdir(os.path.expanduser(model))


def go_offline_if_unreachable() -> None:
    """HF_HUB_OFFLINE=1 when the hub does not answer within seconds (instead of a minute of retries)."""
    if not _offline() and not hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"
        log.warning("the Hugging Face hub (%s) is unreachable: offline mode, only cached models and datasets load", _endpoint())


def check_cached(model: str) -> None:
    if _offline() and not _cached(model):
        raise FileNotFoundError(
            f"model {model!r} is not in the local Hugging Face cache and the hub is offline; download it once with "
            f"network access (hf download {model}), or pass --model with a local directory or tandem:tiny"
        )


def _check_sinks(report_to: tuple[str, ...]) -> None:
    """--report_to wandb or trackio without the package: an error now, not after the model loaded."""
    import importlib.util

    for name in report_to:
        if name in ("wandb", "trackio") and importlib.util.find_spec(name) is None:
            raise ValueError(f"--report_to {name} needs the {name} package: pip install {name}")


def hub_reachable() -> bool:
    """Whether a TCP connection to the hub's endpoint (HF_ENDPOINT) opens within a few seconds."""
    url = urlparse(_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except ValueError:  # not a valid repo id: loading will say so
        return True


def _looks_like_file(spec: str) -> bool:
    return spec.endswith(FILE_SUFFIXES) or spec.startswith((".", "/", "~"))
