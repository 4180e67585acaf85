"""A tiny random chat model for the tool-calling and reasoning tests, and a logits processor that steers it.

The model: a two-layer random Llama over a byte-level tokenizer (every byte a token, no merges) with the chat
markers as added tokens, and a Qwen-style chat template that renders `tools`, assistant `tool_calls` and tool
results, and opens `<think>` in the generation prompt, as DeepSeek-R1's newer templates do.

Random weights never call a tool on their own, so the `force_text` logits processor plugin (written out as an
installed distribution) makes every request *without* a structured-output constraint emit one fixed text,
token by token, then EOS: the server's parsers then see exactly what a reasoning model calling a tool writes.
Requests with a constraint (tool_choice "required" or a named function) are left to the grammar alone.
No tests here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

REASONING = "The user wants the weather in Paris, so I call get_weather."
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
FORCED_TEXT = f"{REASONING}</think>\n\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"

CHAT_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each call write <tool_call>{"name": <name>, "arguments": <arguments object>}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{%- for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""

FORCE_TEXT_PLUGIN = '''
"""Test plugin: every unconstrained request emits `token_ids`, then EOS (tests/tool_models.py)."""
from pydantic import BaseModel

from pagedllm.api import hookimpl


class ForceTextConfig(BaseModel):
    token_ids: list[int]
    eos_token_id: int


class ForceText:
    def __init__(self, context):
        self.ids = list(context.config.token_ids)
        self.eos = context.config.eos_token_id

    def apply(self, logits, batch):
        import torch

        rows, targets = [], []
        for row, (params, out) in enumerate(zip(batch.params, batch.output_token_ids)):
            if params.structured_outputs is not None:
                continue  # the grammar decides
            rows.append(row)
            targets.append(self.ids[len(out)] if len(out) < len(self.ids) else self.eos)
        if rows:
            r, t = torch.tensor(rows), torch.tensor(targets)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits


@hookimpl
def register_logits_processors(register):
    register("force_text", lambda: ForceText, config_model=ForceTextConfig)
'''


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])  # kept in decoded text, as Qwen's
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tool_model(root: Path, seed: int = 0) -> str:
    """Save (once) the tiny model and its tokenizer under root; return the folder."""
    import transformers

    path = root / "tiny-tool-model"
    if (path / "config.json").exists():
        return str(path)
    tok = make_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.25,
        bos_token_id=None, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def write_force_text_plugin(site: Path) -> None:
    """Lay out the `force_text` plugin as an installed distribution in `site` (put it on PYTHONPATH)."""
    (site / "force_text_plugin.py").write_text(FORCE_TEXT_PLUGIN)
    info = site / "pagedllm_test_force_text-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pagedllm-test-force-text\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pagedllm.logits_processors]\nforce_text = force_text_plugin\n")
