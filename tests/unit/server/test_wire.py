"""The server's request schemas: each limit written once, in the layer both sides of the wire import."""

from __future__ import annotations

import ast
import inspect

from tandemrl.server import openai, wire


def test_the_schemas_take_their_limits_from_types_not_from_the_client():
    """wire.py imported the batch limit from the client (generation/remote/batch.py): the server's schema
    hung on the client's module. It now lives in types.py, which both import."""
    imported = {node.module for node in ast.walk(ast.parse(inspect.getsource(wire))) if isinstance(node, ast.ImportFrom)}
    assert not any(m and m.startswith("tandemrl.generation") for m in imported), imported
    assert wire.GenerateBatchRequest.model_fields["items"].metadata[-1].max_length == wire.MAX_BATCH_ITEMS


def test_n_is_bounded_once_for_the_native_and_openai_routes():
    source = inspect.getsource(openai)
    assert "le=MAX_N" not in source  # the bound is wire.n_field's, not a second copy
    for model in (wire.GenerateRequest, openai.CompletionRequest, openai.ChatRequest):
        bounds = {type(m).__name__: m for m in model.model_fields["n"].metadata}
        assert bounds["Ge"].ge == 1 and bounds["Le"].le == wire.MAX_N, model
