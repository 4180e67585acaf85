"""The `gguf` loader: one .gguf file holds the config, tokenizer, chat template and (quantized) weights.

A file with quantized matrices reports quantization_config {"quant_method": "gguf"}, so by default on the CPU
the `gguf` method keeps them in their blocks: the loader then sends each matrix as `GGUFBlocks` (file bytes and
type). When the model's layers use another method (`quantization: none`, a GPU without `quantization: gguf`,
or a file of float matrices), the
weights are dequantized to float32 at load time and the model runs as an ordinary dense checkpoint. The header is parsed once per load and kept between
`load_info` and `load_weights` on this loader instance (keyed by path, size and mtime); the tensor bytes stay
memory-mapped and are dequantized one tensor at a time by gguf-py's `quants.dequantize`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from gguf import GGMLQuantizationType

from pagedllm.api.loading import LoadedModelInfo
from pagedllm.plugins.loaders.gguf.config import build_hf_config, eos_token_ids
from pagedllm.plugins.loaders.gguf.file import GGUF_MAGIC, GGUFError, GGUFFile
from pagedllm.plugins.loaders.gguf.tensors import iter_gguf_weights, iter_hf_weights

__all__ = ["GGUFError", "GGUFLoader", "iter_hf_weights"]

logger = logging.getLogger(__name__)


class GGUFLoader:
    """ModelLoader for a single GGUF file (llama, qwen2, qwen3 architectures)."""

    def __init__(self) -> None:
        self._gguf: GGUFFile | None = None
        self._gguf_key: tuple[str, int, int] | None = None

    def check(self, model: str) -> list[str]:
        """Reasons this loader cannot read `model`: not a .gguf name, missing, or no b'GGUF' magic."""
        if not model.endswith(".gguf"):
            return [f"'{model}' is not a .gguf file"]
        if not os.path.isfile(model):
            return [f"'{model}' does not exist"]
        with open(model, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            return [f"'{model}' is not a GGUF file: bad magic {magic!r} (expected {GGUF_MAGIC!r})"]
        return []

    def load_info(self, model: str, tokenizer: str | None = None) -> LoadedModelInfo:
        """Config, tokenizer (with the file's chat template) and end-of-generation ids, all from the file.

        `tokenizer` names a Hugging Face tokenizer (folder or id) to use instead of the file's own.
        """
        gguf = self._open(model)
        return LoadedModelInfo(
            hf_config=build_hf_config(gguf),
            tokenizer=_load_tokenizer(gguf, tokenizer),
            eos_token_ids=eos_token_ids(gguf),
            quantization_config=_quantization_config(gguf),
            source=model,
        )

    def load_weights(self, module: torch.nn.Module, model: str, info: LoadedModelInfo) -> None:
        """Stream the dequantized, HF-named tensors into `module.load_weights`; errors name `model`."""
        gguf = self._open(model)
        try:
            weights = iter_gguf_weights(gguf, keep_quantized=_takes_blocks(module))
            try:
                module.load_weights(weights)  # type: ignore[operator]
            except GGUFError:
                raise  # ours already names the file
            except ValueError as exc:  # the model's WeightLoadError: a missing or mis-shaped tensor
                raise _naming(exc, model) from exc
        finally:
            # The weights now live in the module; drop the parsed header and the file mapping.
            self._gguf = self._gguf_key = None

    def _open(self, model: str) -> GGUFFile:
        """The parsed header of `model`, reused while the file is unchanged."""
        try:
            st = os.stat(model)
        except FileNotFoundError:
            raise FileNotFoundError(f"GGUF file '{model}' does not exist") from None
        key = (os.path.realpath(model), st.st_size, st.st_mtime_ns)
        if self._gguf is None or self._gguf_key != key:
            self._gguf, self._gguf_key = GGUFFile(model), key
        return self._gguf


def _quantization_config(gguf: GGUFFile) -> dict[str, Any] | None:
    """{"quant_method": "gguf"} when any matrix is stored quantized; None for F32/F16/BF16 files."""
    dense = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    if any(len(t.shape) == 2 and t.ggml_type not in dense for t in gguf.tensors):
        # dense_fallback: the engine may run the file dequantized (off the CPU it does unless asked; builder.py).
        return {"quant_method": "gguf", "dense_fallback": True}
    return None


def _takes_blocks(module: torch.nn.Module) -> bool:
    """Whether the model's layers were built by a method that stores GGUF blocks (the `gguf` method)."""
    return any(getattr(getattr(m, "quant_method", None), "takes_gguf_blocks", False) for m in module.modules())


def _naming(exc: ValueError, path: str) -> ValueError:
    """The same kind of error with the file's path in front, keeping the type where its constructor allows."""
    message = f"'{path}': {exc}"
    try:
        return type(exc)(message)
    except TypeError:  # e.g. UnicodeDecodeError takes five arguments
        return ValueError(message)


def _load_tokenizer(gguf: GGUFFile, override: str | None) -> Any:
    """The tokenizer described by the file's ``tokenizer.ggml.*`` metadata, built offline by transformers."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if override is not None:
        return AutoTokenizer.from_pretrained(override)
    path = gguf.path
    if "tokenizer.ggml.tokens" not in gguf.metadata:
        logger.warning("'%s' has no tokenizer metadata; running without a tokenizer (token ids only)", path)
        return None
    folder, filename = os.path.split(os.path.abspath(path))
    try:
        # NOTE: the fast-tokenizer class reads only the tokenizer keys; AutoTokenizer would first parse the
        # whole file with gguf-py's slow reader to learn the model type (seconds), for the same tokenizer.
        tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    except Exception as exc:
        raise GGUFError(f"'{path}': cannot build a tokenizer from its GGUF metadata ({exc})") from exc
    template = gguf.metadata.get("tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    return tok
