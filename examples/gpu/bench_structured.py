"""Structured-output overhead on one GPU: output tok/s with and without a JSON schema, pagedllm or vLLM 0.20.0.

    python examples/gpu/bench_structured.py --save-tokenizer DIR          # on a machine with the embedded model
    python examples/gpu/bench_structured.py --engine pagedllm --tokenizer DIR --out $OUT/so_pagedllm.json
    python examples/gpu/bench_structured.py --engine vllm --tokenizer DIR --out $OUT/so_vllm.json
    python examples/gpu/bench_structured.py --table $OUT/so_vllm.json $OUT/so_pagedllm.json

Model: the Llama-3.1-8B shape (examples/gpu/h200_check.py), bf16, dummy weights, beside the embedded SmolLM2's
tokenizer (49,152 tokens; the grammar masks the other 79,104 rows of the 8B vocabulary, which no text token
reaches). Both engines get the same prompt token ids (chat template applied here), greedy, xgrammar, compact
JSON (disable_any_whitespace: with dummy weights a model free to add whitespace between tokens fills its
output with it, and never walks the schema).

Per concurrency level N (32 and 256 by default), N requests go to one generate() call:
  free    ignore_eos, max_tokens=M: every request decodes M tokens;
  schema  the JSON schema below, max_tokens=M, no ignore_eos.
The schema is an ordinary nested one (strings, a bounded integer, an enum, an array, a nested object with a
pattern) whose last field is an array of at least 300 strings (600 tokens or more), so that no request can
close the JSON within M = 256 tokens: with dummy weights the two engines' models pick different tokens, and a free-length schema
would end requests at different points, which changes the batch size and so the tok/s for reasons that are not
the grammar's. Every schema request must therefore end at max_tokens (checked and reported); its first tokens
walk the structural part of the grammar (object keys, enum, integer, array, pattern), the rest strings and the separators between them.
Runs alternate free / schema after one warm-up of each (the warm-up compiles the grammar; both engines cache it);
the figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from h200_check import LLAMA_8B_CONFIG  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,12}$"},
                 "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Lima", "Oslo", "Kyoto"]}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "notes": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{8,40}$"}, "minItems": 300},
    },
    "required": ["name", "age", "role", "tags", "address", "notes"],
    "additionalProperties": False,
}
PEOPLE = ["a chef", "a pilot", "a student", "a painter", "a nurse", "a farmer", "a coder", "a singer",
          "a judge", "a sailor", "a baker", "a miner", "a poet", "a diver", "a tailor", "a drummer"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def save_tokenizer(dest: str) -> None:
    """The embedded SmolLM2's tokenizer (and chat template) as Hugging Face files, for the offline GPU machine."""
    from transformers import AutoTokenizer

    from pagedllm.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(dest)
    print(f"saved {len(tok)}-token tokenizer to {dest}: {sorted(os.listdir(dest))}")


# --tiny: the same vocabulary on two small layers, to try the script on a CPU.
TINY: dict[str, Any] = {**LLAMA_8B_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def model_dir(tokenizer_dir: str, dest: str, tiny: bool) -> str:
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(TINY if tiny else LLAMA_8B_CONFIG, f)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), dest)
    return dest


def prompts(tokenizer_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    system = ("You answer with one JSON object that follows this schema, nothing else: "
              + json.dumps(SCHEMA))
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} (person number {i}) as JSON."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        out.append([int(x) for x in ids])
    return out


class Engine:
    """The two engines behind one generate(prompt ids, mode) call."""

    def __init__(self, name: str, path: str, max_tokens: int, device: str, trace: bool = False) -> None:
        self.name, self.max_tokens = name, max_tokens
        self.trace: Any = None
        t0 = time.perf_counter()
        if name == "vllm":
            from vllm import LLM, SamplingParams
            from vllm.sampling_params import StructuredOutputsParams

            self.llm = LLM(model=path, tokenizer=path, load_format="dummy", dtype="bfloat16",
                           gpu_memory_utilization=0.9, seed=0, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
            so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
            self.wrap = lambda ids: {"prompt_token_ids": ids}
        else:
            from pagedllm import LLM, SamplingParams
            from pagedllm.config import EngineConfig
            from pagedllm.sampling_params import StructuredOutputsParams

            cfg = EngineConfig.from_dict({
                "model": path, "dtype": "bfloat16" if device == "cuda" else "float32", "device": device, "seed": 0,
                "loader": {"name": "dummy"},
                "kv_cache": {"gpu_memory_utilization": 0.9}, "scheduler": {"max_num_seqs": 1024, "async_scheduling": True},
                "structured_outputs": {"backend": "xgrammar"}})
            self.llm = LLM(config=cfg)
            if trace:
                from grammar_trace import GrammarTrace

                self.trace = GrammarTrace(self.llm)
            so = StructuredOutputsParams(json=SCHEMA, backend="xgrammar", disable_any_whitespace=True)
            self.wrap = lambda ids: {"prompt_token_ids": ids}
        self.startup_s = round(time.perf_counter() - t0, 1)
        self.params = {
            "free": SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False),
            "schema": SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False,
                                     structured_outputs=so),
        }

    # Two names for one call, so that a sampling profiler's stacks say which mode a sample was taken in.
    def _free_generate(self, prompts: list[Any], params: Any) -> Any:
        return self.llm.generate(prompts, params, use_tqdm=False)

    def _schema_generate(self, prompts: list[Any], params: Any) -> Any:
        return self.llm.generate(prompts, params, use_tqdm=False)

    def run(self, ids: list[list[int]], mode: str) -> dict[str, Any]:
        if self.trace is not None:
            self.trace.start_run()
        t0 = time.perf_counter()
        generate = self._schema_generate if mode == "schema" else self._free_generate
        outs = generate([self.wrap(x) for x in ids], self.params[mode])
        wall = time.perf_counter() - t0
        lens = [len(o.outputs[0].token_ids) for o in outs]
        reasons = [str(o.outputs[0].finish_reason) for o in outs]
        result = {"wall_s": wall, "output_tokens": sum(lens), "tok_s": sum(lens) / wall,
                  "short": sum(n != self.max_tokens for n in lens), "finish": sorted(set(reasons)),
                  "first_ids": list(outs[0].outputs[0].token_ids[:48])}
        if self.trace is not None:
            result["trace"] = self.trace.report()
            print(f"[trace N={len(ids)} {mode}] {result['tok_s']:.0f} tok/s {json.dumps(result['trace'])}", flush=True)
        return result


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    path = model_dir(args.tokenizer, args.model_dir, args.tiny)
    levels = [int(x) for x in args.concurrency.split(",")]
    all_ids = prompts(args.tokenizer, max(levels))
    if args.grammar_threads is not None:
        import xgrammar as xgr

        from pagedllm.plugins.structured_output.xgrammar import backend as xgrammar_backend
        xgrammar_backend._ACCEPT_THREADS = args.grammar_threads
        xgrammar_backend._BATCH = xgr.BatchGrammarMatcher(max_threads=args.grammar_threads)
    if args.accept_threads is not None:
        from pagedllm.plugins.structured_output.xgrammar import backend as xgrammar_backend
        xgrammar_backend._ACCEPT_THREADS = args.accept_threads
    if args.no_ahead:
        from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarGrammar
        XgrammarGrammar.gil_free_batches = False  # accepted by the engine thread's advance, filled at sampling
    if args.switch_interval_us is not None:
        from pagedllm.structured_output import ahead
        ahead.SWITCH_INTERVAL_S = args.switch_interval_us * 1e-6
    engine = Engine(args.engine, path, args.max_tokens, args.device, args.trace)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    result: dict[str, Any] = {"engine": args.engine, "startup_s": engine.startup_s, "max_tokens": args.max_tokens,
                              "prompt_tokens_mean": statistics.mean(len(x) for x in all_ids), "levels": {},
                              "settings": {"grammar_threads": args.grammar_threads,
                                           "accept_threads": args.accept_threads,
                                           "switch_interval_us": args.switch_interval_us,
                                           "no_ahead": args.no_ahead}}
    for n in levels:
        ids = all_ids[:n]
        warm = {mode: engine.run(ids, mode) for mode in ("free", "schema")}
        runs: dict[str, list[dict[str, Any]]] = {"free": [], "schema": []}
        for _ in range(args.repeats):
            for mode in ("free", "schema"):
                runs[mode].append(engine.run(ids, mode))
        level = {mode: {"tok_s": statistics.median(r["tok_s"] for r in rs),
                        "runs_tok_s": [round(r["tok_s"], 1) for r in rs],
                        **({"traces": [r["trace"] for r in rs]} if args.trace else {}),
                        "short_requests": max(r["short"] for r in rs), "finish": rs[-1]["finish"]}
                 for mode, rs in runs.items()}
        level["warmup_s"] = {mode: round(w["wall_s"], 2) for mode, w in warm.items()}
        level["ratio_schema_free"] = level["schema"]["tok_s"] / level["free"]["tok_s"]
        level["schema_text_start"] = tok.decode(runs["schema"][-1]["first_ids"])
        result["levels"][str(n)] = level
        print(f"[{args.engine} N={n}] free {level['free']['tok_s']:.0f} tok/s, schema "
              f"{level['schema']['tok_s']:.0f} tok/s, ratio {level['ratio_schema_free']:.3f}; schema requests "
              f"short of max_tokens: {level['schema']['short_requests']}; text: {level['schema_text_start']!r}",
              flush=True)
    return result


def table(paths: list[str]) -> str:
    res: dict[str, Any] = {}
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
            res[r["engine"]] = r
    lines = ["| N | engine | free tok/s | schema tok/s | schema / free | pagedllm / vLLM (schema) |",
             "|---|---|---|---|---|---|"]
    levels = sorted({int(n) for r in res.values() for n in r["levels"]})
    for n in levels:
        for name, r in res.items():
            lv = r["levels"].get(str(n))
            if not lv:
                continue
            vs = ""
            if name == "pagedllm" and "vllm" in res and str(n) in res["vllm"]["levels"]:
                vs = f"{lv['schema']['tok_s'] / res['vllm']['levels'][str(n)]['schema']['tok_s']:.3f}x"
            lines.append(f"| {n} | {name} | {lv['free']['tok_s']:.0f} | {lv['schema']['tok_s']:.0f} | "
                         f"{lv['ratio_schema_free']:.3f} | {vs} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm")
    ap.add_argument("--tokenizer", default=".sob/tok", help="folder with the saved SmolLM2 tokenizer files")
    ap.add_argument("--model-dir", default="/tmp/so_8b")
    ap.add_argument("--concurrency", default="32,256")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="pagedllm only (cpu: with --tiny, to try the script)")
    ap.add_argument("--tiny", action="store_true", help="a two-layer model with the 8B vocabulary")
    ap.add_argument("--trace", action="store_true", help="pagedllm only: per run, the grammar work's time per "
                    "step and the state left behind (grammar_trace.py)")
    ap.add_argument("--grammar-threads", type=int, default=None, help="pagedllm only: threads of xgrammar's batch "
                    "accept and fill (default: the backend's, half the cores, at most 4 for accept)")
    ap.add_argument("--accept-threads", type=int, default=None, help="pagedllm only: threads of the batch accept "
                    "alone (the fill keeps its own)")
    ap.add_argument("--no-ahead", action="store_true", help="pagedllm only: no grammar worker beside the "
                    "engine thread (structured_output/manager.py NOTE 4): accept and fill on the engine thread")
    ap.add_argument("--switch-interval-us", type=float, default=None, help="pagedllm only: the interpreter's "
                    "switch interval while the grammar worker runs (structured_output/ahead.py NOTE 1)")
    ap.add_argument("--save-tokenizer", metavar="DIR", default=None)
    ap.add_argument("--table", nargs="+", metavar="JSON", default=None)
    args = ap.parse_args()
    if args.save_tokenizer:
        save_tokenizer(args.save_tokenizer)
        return 0
    if args.table:
        print(table(args.table))
        return 0
    result = bench(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
