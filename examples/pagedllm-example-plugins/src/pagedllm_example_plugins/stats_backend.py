"""pagedllm's torch attention backend, counting each step's tokens and requests.

`build_metadata` runs once per model step, so it is where a backend sees the batch: the counts are kept on
the class (the backend is a class with static methods; the engine never instantiates it).

A plugin never imports another plugin's modules (docs/plugins/api.md): the torch backend this one extends is
asked of the plugin manager by its registered name, when this module is first imported -- which is when the
engine loads this backend, after discovery.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.api import PluginKind
from pagedllm.api.attention import CommonAttentionMetadata
from pagedllm.api.engine import get_plugin_manager

_torch = get_plugin_manager().get(PluginKind.ATTENTION, "torch")
if _torch is None:
    raise ImportError("stats_torch extends pagedllm's 'torch' attention backend, which is not registered")
TorchSDPABackend: Any = _torch.resolve()


class StatsTorchBackend(TorchSDPABackend):
    name: ClassVar[str] = "stats_torch"
    tokens_per_step: ClassVar[list[int]] = []
    requests_per_step: ClassVar[list[int]] = []

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> Any:
        StatsTorchBackend.tokens_per_step.append(common.num_actual_tokens)
        StatsTorchBackend.requests_per_step.append(common.num_reqs)
        return TorchSDPABackend.build_metadata(common)

    @classmethod
    def reset(cls) -> None:
        cls.tokens_per_step.clear()
        cls.requests_per_step.clear()
