"""A model's config.json read without transformers: the engine's view of `hf_config`.

`from transformers import AutoConfig` imports transformers' model-loading stack (torch.distributed.tensor,
sympy, the hub client): 1.5-3 s of a start-up whose own work on a tiny model is a fraction of that. The engine
reads a few dozen fields of the config, all plain values, so for the architectures it knows
(`architecture_defaults.KNOWN_MODEL_TYPES`) the file is read here directly, with the class defaults and the
derived fields transformers' config classes would add; any other model type still goes through AutoConfig
(lazily), so a third-party model plugin sees exactly the config it was written against.

NOTE 1 (parity): tests/test_model_config.py reads every in-tree architecture's tiny config, its minimal
(defaults-left-out) form and hub-style legacy variants both ways and compares every field the engine reads;
the field list is the one a recording config sees while engines for each architecture build and generate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from pagedllm.formats.architecture_defaults import KNOWN_MODEL_TYPES, complete_config


class ModelConfig:
    """config.json's fields as attributes, as a transformers config exposes them (a missing field raises
    AttributeError, so `getattr(cfg, name, None)` reads the same on both).

    `dtype` / `torch_dtype` are torch dtypes (transformers converts the file's string on load); everything
    else is the JSON value after the architecture's defaults and derivations.
    """

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not real attributes; `_values` itself is missing only while
        # unpickling (before __setstate__), when every lookup must fail rather than recurse.
        values = self.__dict__.get("_values")
        if name == "torch_dtype":
            name = "dtype"  # transformers' older name, still read by code written against 4.x
        if values is None or name not in values:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        if name == "dtype":
            return _torch_dtype(values[name])
        return values[name]

    def __setattr__(self, name: str, value: Any) -> None:
        # Writable like a transformers config: tests and tools adjust a field (e.g. num_hidden_layers).
        self._values[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getstate__(self) -> dict[str, Any]:
        return self._values

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(state))

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelConfig) and other._values == self._values

    __hash__ = None  # type: ignore[assignment]  # mutable, like a transformers config

    def __repr__(self) -> str:
        return f"ModelConfig({self._values.get('model_type')!r}, {len(self._values)} fields)"

    def to_dict(self) -> dict[str, Any]:
        """The fields as read (dtype as its string name), a copy."""
        return json.loads(json.dumps(self._values, default=str))


def read_model_config(folder: str, raw: dict[str, Any]) -> Any:
    """The config of the model in `folder` (`raw`: its config.json, already parsed): a ModelConfig for a
    model type in KNOWN_MODEL_TYPES, else transformers' AutoConfig (imported only then)."""
    if raw.get("model_type") in KNOWN_MODEL_TYPES:
        try:
            # `_name_or_path` as transformers sets it: AutoTokenizer matches checkpoint names against it.
            return ModelConfig({**complete_config(raw), "_name_or_path": folder})
        except (TypeError, ValueError, KeyError, ArithmeticError) as exc:
            raise ValueError(f"'{os.path.join(folder, 'config.json')}': {exc}") from exc
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ValueError(
            f"'{os.path.join(folder, 'config.json')}': transformers cannot read this config: {exc}"
        ) from exc


def model_config_from_dict(values: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig for config.json-shaped `values` (their `model_type` one of KNOWN_MODEL_TYPES), with
    the class defaults and derived fields filled in: what a loader of another format (GGUF metadata) hands
    the engine as `hf_config`. ValueError for another model type or a field of the wrong type."""
    model_type = values.get("model_type")
    if model_type not in KNOWN_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one the config reader knows "
                         f"(known: {', '.join(sorted(KNOWN_MODEL_TYPES))})")
    try:
        return ModelConfig(complete_config(dict(values)))
    except (TypeError, KeyError, ArithmeticError) as exc:
        raise ValueError(str(exc)) from exc


def _torch_dtype(value: Any) -> Any:
    # torch is imported by the engine long before a dtype is read; importing it here keeps this module light
    # for the tools that only inspect a folder.
    if not isinstance(value, str):
        return value
    import torch

    dtype = getattr(torch, value, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json: dtype {value!r} is not a torch dtype")
    return dtype
