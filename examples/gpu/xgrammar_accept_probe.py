"""xgrammar's batch accept of 256 matchers alone, after a sleep and right after a batch fill, on this host.

    python examples/gpu/xgrammar_accept_probe.py TOKENIZER_DIR

The matchers walk bench_structured.py's JSON schema with random allowed tokens (paths computed first), so the
timed loop runs only xgrammar's calls: the accept's median over the steps, and the fill's where one runs.
"""
import sys, time, random, json, statistics
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import torch, xgrammar as xgr
from transformers import AutoTokenizer
from bench_structured import SCHEMA
tok = AutoTokenizer.from_pretrained(sys.argv[1])
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152)
comp = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
N, STEPS = 256, 30
raw = xgr.base._core.BatchGrammarMatcher.batch_accept_token
rng = random.Random(0)
# precompute valid token paths
ms = [xgr.GrammarMatcher(comp) for _ in range(N)]
bm = torch.full((N, 49152 // 32), -1, dtype=torch.int32)
batch = xgr.BatchGrammarMatcher()
paths = []
for s in range(STEPS):
    batch.batch_fill_next_token_bitmask(ms, bm, list(range(N)))
    toks = []
    for i in range(N):
        row = bm[i].numpy().view('uint32')
        allowed = [w * 32 + b for w in range(len(row)) if row[w] for b in range(32) if row[w] >> b & 1]
        allowed = [a for a in allowed if a not in info.stop_token_ids] or allowed
        toks.append(rng.choice(allowed))
    assert all(raw([m._handle for m in ms], toks, False))
    paths.append(toks)
print("paths ready", flush=True)
def timed(between):
    ms = [xgr.GrammarMatcher(comp) for _ in range(N)]
    acc, fill = [], []
    for s in range(STEPS):
        t = time.perf_counter(); v = raw([m._handle for m in ms], paths[s], False); acc.append(time.perf_counter() - t)
        if between == "fill":
            t = time.perf_counter(); batch.batch_fill_next_token_bitmask(ms, bm, list(range(N))); fill.append(time.perf_counter() - t)
        elif between == "fill1":
            t = time.perf_counter(); b1.batch_fill_next_token_bitmask(ms, bm, list(range(N))); fill.append(time.perf_counter() - t)
        else:
            time.sleep(0.002)
    return round(1e3 * statistics.median(acc[3:]), 3), round(1e3 * statistics.median(fill[3:]), 3) if fill else None
b1 = xgr.BatchGrammarMatcher(max_threads=1)
for v in ["sleep", "fill", "fill1", "sleep", "fill"]:
    print(v, timed(v), flush=True)
