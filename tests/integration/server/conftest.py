"""Fixtures of the rollout-server tests: one real `tandem rollout` per module and backend (hf always,
engine once `tandemrl.generation.engine` imports); fault tests start their own."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the test modules here import rollout_helpers (importlib import mode)
from rollout_helpers import BACKENDS, start_server  # noqa: E402


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, backend: str):
    s = start_server(tiny_model_dir, backend=backend)
    yield s
    s.stop()
