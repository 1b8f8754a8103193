"""User code by name: `module:attr` or `path/to/file.py:attr`, for reward functions, tools, tool-call
parsers and judges. Every failure is one ValueError/FileNotFoundError that says what to fix."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import traceback
from typing import Any


def load_object(spec: str, *, what: str) -> Any:
    """The object `spec` names. `what` names the kind in errors ("tool", "reward function", ...).

    Example: load_object("json:dumps", what="tool") -> json.dumps
    """
    if ":" not in spec:
        raise ValueError(f"{what} '{spec}': give module:name or path/file.py:name")
    source, attr = spec.rsplit(":", 1)
    module = _load_file(source, spec, what) if source.endswith(".py") else _import(source, spec, what)
    if not hasattr(module, attr):
        raise ValueError(f"{what} '{spec}': '{source}' has no function '{attr}'; check the name after the colon")
    return getattr(module, attr)


def _import(module_name: str, spec: str, what: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{what} '{spec}': cannot import '{module_name}' ({error}); install it or put it on PYTHONPATH") from None


def _load_file(path: str, spec: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} '{spec}': file '{path}' does not exist; pass an existing path/file.py:name")
    module_name = "tandem_plugin_" + re.sub(r"\W", "_", os.path.abspath(path).removesuffix(".py"))
    if module_name in sys.modules:  # one file named twice (a tool and a reward) is loaded once
        return sys.modules[module_name]
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module  # dataclasses and pickling inside the file look themselves up here
    try:
        file_spec.loader.exec_module(module)
    except SyntaxError as error:
        del sys.modules[module_name]
        raise ValueError(f"{what} '{spec}': {path}:{error.lineno}: SyntaxError: {error.msg}") from None
    except Exception as error:  # the user's module raised on import: name its own line, not ours
        del sys.modules[module_name]
        line = next((f.lineno for f in reversed(traceback.extract_tb(error.__traceback__)) if f.filename == file_spec.origin), "?")
        message = " ".join(str(error).split())
        raise ValueError(f"{what} '{spec}': {path}:{line}: importing it raised {type(error).__name__}: {message}") from None
    return module
