"""`pagedllm chat`: an interactive conversation with the model's chat template."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedllm.cli.engine_args import add_engine_args, engine_config_from_args
from pagedllm.cli.generate_cmd import add_sampling_args, sampling_params_from_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat (empty line or Ctrl-D to quit)")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, max_tokens=256)


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm import LLM

    llm = LLM(config=engine_config_from_args(args))
    params = sampling_params_from_args(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        out = llm.chat(messages, params, use_tqdm=False)[0]
        reply = out.outputs[0].text
        print(reply, flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0
