"""`pagedllm generate`: run prompts (or chat messages) through the engine and print the text."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.cli.engine_args import add_engine_args, engine_config_from_args

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string; repeatable")


def sampling_params_from_args(args: argparse.Namespace) -> Any:
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("--prompt", action="append", default=None, help="prompt text; repeatable (default: a question)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--raw", action="store_true", help="send prompts as raw text instead of through the chat template")
    p.add_argument("--json", action="store_true", help="print JSON lines with ids, text and finish reasons")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm import LLM

    prompts: list[str] = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    llm = LLM(config=engine_config_from_args(args))
    params = sampling_params_from_args(args)
    tok = llm.get_tokenizer()
    use_chat = not args.raw and tok is not None and getattr(tok, "chat_template", None)
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        comp = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": comp.text, "token_ids": comp.token_ids,
                              "finish_reason": comp.finish_reason, "error": out.error}))
        else:
            print(f"### {prompt}\n{comp.text if not out.error else 'error: ' + out.error}\n")
    return 1 if any(o.error for o in outputs) and len(outputs) == 1 else 0


