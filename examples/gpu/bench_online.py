"""The online path beside `vllm serve`: the pieces examples/gpu/device/online.sh runs (one server per engine).

    python examples/gpu/bench_online.py prepare DIR [--tiny]      # config.json + a tokenizer of the model's vocabulary
    python examples/gpu/bench_online.py load URL DIR --label L --out OUT.json [--loadgen vllm,pagedllm]
    python examples/gpu/bench_online.py table OUT_A.json OUT_B.json ...

Model: the Llama-3.1-8B shape (examples/gpu/h200_check.py's LLAMA_8B_CONFIG), bf16, dummy weights. Its 128,256-token
vocabulary needs a tokenizer of that size, so that every id the dummy model samples has text and the detokenizer
does its full work: `prepare` builds a byte-level BPE (GPT-2 / Llama-3 style: 256 byte tokens, 127,744 merges into
word-like pieces of up to 8 letters, then 256 special tokens at 128,000-128,255 with <|begin_of_text|> and
<|end_of_text|> where Llama 3 has them), deterministic, with `tokenizers`; both servers load the same files.
Its text is not a language's, but decoding it costs what decoding a real BPE vocabulary of that size costs.

`load` drives one running server with the same matrix for every engine: concurrency 1 / 64 / 256 (--concurrency),
two prompt sets -- `random` (vLLM's random dataset: --input-len random ids, decoded to text) and `prefix` (vLLM's
prefix_repetition: --num-prefixes shared prefixes of --prefix-len tokens, each request its own --suffix-len
suffix) -- streaming /v1/completions, greedy, ignore_eos, --output-len tokens each. The load generators:
  vllm      vLLM 0.20.0's `vllm bench serve` (vllm.benchmarks.serve, imported once, one run per cell),
            --backend openai: TTFT, ITL and TPOT percentiles, output tok/s, as vLLM reports them;
  pagedllm  ours (`pagedllm bench serve`, plugins/commands/bench/serve_load.py) on the same prompts' text.
Requests per cell: max(--min-requests, --waves x concurrency), so each cell is a few full waves.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import sys
import time
from typing import Any

LLAMA_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02, "use_cache": True,
}
# --tiny: the same vocabulary on two small layers, to try the whole recipe on a CPU.
TINY: dict[str, Any] = {**LLAMA_8B_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "float32"}
NUM_SPECIAL = 256
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def synthetic_bpe(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids (module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab: dict[str, int] = {}
    for ch in sorted(alphabet, key=lambda c: ord(c)):
        vocab[ch] = len(vocab)
    space = "\u0120"  # ByteLevel's picture of " "
    rng = random.Random(seed)
    # Every token is an earlier one plus a letter (a trie of words, with or without the leading space), so
    # each merge joins two tokens already in the vocabulary; only pieces under 8 letters are extended.
    extendable = [space + c for c in LETTERS] + list(LETTERS)
    merges: list[tuple[str, str]] = []

    def add(a: str, b: str) -> bool:
        tok = a + b
        if tok in vocab or a not in vocab or b not in vocab:
            return False
        vocab[tok] = len(vocab)
        merges.append((a, b))
        return True

    for c in LETTERS:  # " a" ... " z" first: every word start has a token
        add(space, c)
    target = vocab_size - NUM_SPECIAL
    while len(vocab) < target:
        i = rng.randrange(len(extendable))
        a = extendable[i]
        if add(a, rng.choice(LETTERS)) and len(a.lstrip(space)) < 7:
            extendable.append(merges[-1][0] + merges[-1][1])
        elif len(a.lstrip(space)) >= 7:
            extendable[i] = extendable[-1]
            extendable.pop()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS] + [f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL - 2)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size(with_added_tokens=True)
    assert tok.token_to_id(BOS) == vocab_size - NUM_SPECIAL
    return tok


def prepare(dest: str, tiny: bool) -> None:
    from transformers import PreTrainedTokenizerFast

    os.makedirs(dest, exist_ok=True)
    cfg = TINY if tiny else LLAMA_8B_CONFIG
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    t0 = time.perf_counter()
    fast = PreTrainedTokenizerFast(tokenizer_object=synthetic_bpe(cfg["vocab_size"]), bos_token=BOS, eos_token=EOS,
                                   model_max_length=cfg["max_position_embeddings"])
    fast.save_pretrained(dest)
    print(f"prepared {dest}: {len(fast)}-token tokenizer in {time.perf_counter() - t0:.1f} s, "
          f"{'tiny' if tiny else '8B'} config")


# -- prompts -------------------------------------------------------------------------------------------------


def _random_ids(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


@functools.cache
def _tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def prompt_texts(tokenizer_dir: str, dataset: str, num: int, args: argparse.Namespace) -> list[str]:
    """Prompts like vLLM's generator makes, as one-line text for ours: random ids decoded (newlines removed:
    our --prompts-file takes one prompt per line)."""
    tok = _tokenizer(tokenizer_dir)
    rng = random.Random(args.seed)
    high = len(tok) - NUM_SPECIAL

    def text(ids: list[int]) -> str:
        return " ".join(tok.decode(ids).split())

    def of_len(n: int) -> str:
        # Decoded random ids re-encode to about twice as many tokens; cut to n as vLLM's random dataset does.
        ids = tok.encode(text(_random_ids(rng, n, 0, high)), add_special_tokens=False)[:n]
        return text(ids)

    if dataset == "random":
        return [of_len(args.input_len) for _ in range(num)]
    prefixes = [of_len(args.prefix_len) for _ in range(args.num_prefixes)]
    return [prefixes[i % len(prefixes)] + " " + of_len(args.suffix_len) for i in range(num)]


# -- load generators -----------------------------------------------------------------------------------------


def _vllm_cell(url: str, tokenizer_dir: str, dataset: str, concurrency: int, num: int, args: argparse.Namespace,
               result_dir: str) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    name = f"vllm_{args.label}_{dataset}_c{concurrency}.json"
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", args.model_name,
            "--tokenizer", tokenizer_dir, "--num-prompts", str(num), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--num-warmups", "0", "--disable-tqdm", "--save-result", "--result-dir", result_dir,
            "--result-filename", name]
    if dataset == "random":
        argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
                 str(args.output_len), "--random-range-ratio", "0"]
    else:
        argv += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                 "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes",
                 str(args.num_prefixes), "--prefix-repetition-output-len", str(args.output_len)]
    res = main(parser.parse_args(argv))
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput")
    out = {k: res.get(k) for k in keep}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99"):
            key = f"{stat}_{metric}_ms"
            if key in res:
                out[key] = res[key]
    return out


def _ours_cell(url: str, texts: list[str], concurrency: int, args: argparse.Namespace, workdir: str,
               dataset: str) -> dict[str, Any]:
    from pagedllm.plugins.commands.bench.serve_load import ServeLoadConfig, run_load

    path = os.path.join(workdir, f"prompts_{dataset}_{len(texts)}.txt")
    with open(path, "w") as f:
        f.write("\n".join(texts) + "\n")
    cfg = ServeLoadConfig(base_url=url, model=args.model_name, num_prompts=len(texts), output_len=args.output_len,
                          max_concurrency=concurrency, prompts_file=path, seed=args.seed)
    s = asyncio.run(run_load(cfg))
    s.pop("_samples", None)
    ms = {f"{stat}_{metric}_ms": s[f"{metric}_s"][stat] * 1e3 for metric in ("ttft", "itl", "e2e")
          for stat in ("mean", "p50", "p90", "p99")}
    return {"completed": s["completed"], "failed": s["failed"], "errors": s["errors"][:3],
            "duration": s["duration_s"], "total_output_tokens": s["output_tokens"],
            "request_throughput": s["request_throughput"], "output_throughput": s["output_throughput"], **ms}


_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process (fields 14 and 15 of /proc/PID/stat); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids = [int(x) for x in f.read().split()]
            for kid in kids:
                out += [kid, *_descendants(kid)]
    except OSError:
        pass
    return out


def _server_cpu(pid: int | None) -> tuple[float, float]:
    """(API process, everything it started: the engine core and its helpers) CPU seconds so far."""
    if not pid:
        return 0.0, 0.0
    return _cpu_seconds(pid), sum(_cpu_seconds(p) for p in _descendants(pid))


def _load(args: argparse.Namespace) -> int:
    result_dir = os.path.join(args.raw_dir, args.label)
    os.makedirs(result_dir, exist_ok=True)
    gens = [g for g in args.loadgen.split(",") if g]
    datasets = [d for d in args.datasets.split(",") if d]
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, Any] = {"label": args.label, "url": args.url, "settings": {
        k: getattr(args, k) for k in ("input_len", "output_len", "prefix_len", "suffix_len", "num_prefixes",
                                      "waves", "min_requests", "seed")}, "cells": []}
    if "vllm" in gens:  # vLLM's import (tens of seconds) stays out of the first cell's time and CPU figures
        import vllm.benchmarks.serve  # noqa: F401
    t_start = time.perf_counter()
    if args.warmup:  # CUDA graphs, allocator pools and first-request paths stay out of the first cell
        texts = prompt_texts(args.tokenizer, "random", args.warmup, args)
        _ours_cell(args.url, texts, args.warmup, args, result_dir, "warmup")
    for gen in gens:
        for dataset in datasets:
            for c in levels:
                num = max(args.min_requests, args.waves * c)
                if dataset == "prefix":  # vLLM's prefix set needs a request per prefix at least
                    num = max(num, args.num_prefixes)
                t0 = time.perf_counter()
                api0, rest0 = _server_cpu(args.server_pid)
                try:
                    if gen == "vllm":
                        cell = _vllm_cell(args.url, args.tokenizer, dataset, c, num, args, result_dir)
                    else:
                        cell = _ours_cell(args.url, prompt_texts(args.tokenizer, dataset, num, args), c, args,
                                          result_dir, dataset)
                except (Exception, SystemExit) as exc:  # one failed cell must not lose the others (one device call)
                    cell = {"error": f"{type(exc).__name__}: {exc}"}
                api1, rest1 = _server_cpu(args.server_pid)
                cell.update(loadgen=gen, dataset=dataset, concurrency=c, num_requests=num,
                            wall_s=round(time.perf_counter() - t0, 1))
                if args.server_pid and cell.get("total_output_tokens"):
                    # The API process's CPU per 1k output tokens: the figure that says whether it is the limit.
                    per_k = 1000.0 / cell["total_output_tokens"]
                    cell.update(api_cpu_s=round(api1 - api0, 2), core_cpu_s=round(rest1 - rest0, 2),
                                api_cpu_s_per_1k_tokens=round((api1 - api0) * per_k, 4),
                                core_cpu_s_per_1k_tokens=round((rest1 - rest0) * per_k, 4))
                results["cells"].append(cell)
                print(f"[{args.label}] {gen:8s} {dataset:6s} c={c:<4d} " + _summary(cell), flush=True)
                with open(args.out, "w") as f:  # after every cell: a timeout keeps what finished
                    json.dump(results, f, indent=1)
    print(f"[{args.label}] load matrix in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


def _summary(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return "ERROR " + cell["error"][:300]
    ttft = cell.get("p99_ttft_ms")
    api = f", API {cell['api_cpu_s_per_1k_tokens']:.3f} CPU s/1k tok" if "api_cpu_s_per_1k_tokens" in cell else ""
    return (f"{cell['completed']}/{cell['num_requests']} ok, out {cell['output_throughput']:.0f} tok/s, "
            f"TTFT p50 {cell.get('p50_ttft_ms', cell.get('median_ttft_ms', 0)):.1f} p99 {ttft or 0:.1f} ms, "
            f"ITL p50 {cell.get('p50_itl_ms', cell.get('median_itl_ms', 0)):.2f} p99 {cell.get('p99_itl_ms', 0):.2f} ms"
            f"{api} ({cell['wall_s']} s)")


def table(paths: list[str]) -> str:
    """One row per (load generator, dataset, concurrency): each engine's output tok/s, TTFT and ITL, the ratio
    of the first file's engine over the second's."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    labels = [r["label"] for r in runs]
    head = "| loadgen | prompts | conc | " + " | ".join(
        f"{lab} out tok/s | {lab} TTFT p50/p99 ms | {lab} ITL p50/p99 ms | {lab} API CPU s/1k tok" for lab in labels)
    lines = [head + (f" | {labels[0]}/{labels[1]} out tok/s |" if len(labels) > 1 else " |"),
             "|" + "---|" * (3 + 4 * len(labels) + (1 if len(labels) > 1 else 0))]
    keys = [(c["loadgen"], c["dataset"], c["concurrency"]) for c in runs[0]["cells"]]
    for key in keys:
        cells = [next((c for c in r["cells"] if (c["loadgen"], c["dataset"], c["concurrency"]) == key), None)
                 for r in runs]
        row = f"| {key[0]} | {key[1]} | {key[2]} |"
        for c in cells:
            if c is None or "error" in c:
                row += " - | - | - | - |"
                continue
            p50 = c.get("p50_ttft_ms", c.get("median_ttft_ms", 0))
            i50 = c.get("p50_itl_ms", c.get("median_itl_ms", 0))
            api = c.get("api_cpu_s_per_1k_tokens")
            row += (f" {c['output_throughput']:,.0f} | {p50:.1f} / {c.get('p99_ttft_ms', 0):.1f} |"
                    f" {i50:.2f} / {c.get('p99_itl_ms', 0):.2f} | {'-' if api is None else f'{api:.3f}'} |")
        if len(cells) > 1:
            a, b = cells[0], cells[1]
            ok = a and b and "error" not in a and "error" not in b and b["output_throughput"]
            row += f" {a['output_throughput'] / b['output_throughput']:.3f}x |" if ok else " - |"  # type: ignore[index]
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dest")
    p.add_argument("--tiny", action="store_true")
    ld = sub.add_parser("load")
    ld.add_argument("url")
    ld.add_argument("tokenizer", help="the prepared folder (its tokenizer files)")
    ld.add_argument("--label", required=True)
    ld.add_argument("--out", required=True)
    ld.add_argument("--model-name", default="llama-8b-dummy", help="the served model name on both servers")
    ld.add_argument("--loadgen", default="vllm,pagedllm")
    ld.add_argument("--datasets", default="random,prefix")
    ld.add_argument("--concurrency", default="1,64,256")
    ld.add_argument("--waves", type=int, default=2, help="requests per cell = waves x concurrency ...")
    ld.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    ld.add_argument("--input-len", type=int, default=1024)
    ld.add_argument("--output-len", type=int, default=128)
    ld.add_argument("--prefix-len", type=int, default=1024)
    ld.add_argument("--suffix-len", type=int, default=128)
    ld.add_argument("--num-prefixes", type=int, default=4)
    ld.add_argument("--warmup", type=int, default=32, help="requests sent (and not counted) before the matrix")
    ld.add_argument("--seed", type=int, default=0)
    ld.add_argument("--server-pid", type=int, default=None,
                    help="the server's process: its CPU seconds (and its children's) per cell")
    ld.add_argument("--raw-dir", default="/tmp/bench_online_raw", help="vLLM's per-cell result files")
    tb = sub.add_parser("table")
    tb.add_argument("paths", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dest, args.tiny)
        return 0
    if args.cmd == "table":
        print(table(args.paths))
        return 0
    return _load(args)


if __name__ == "__main__":
    sys.exit(main())
