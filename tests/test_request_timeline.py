"""A request's timeline (RequestMetrics: arrival, queued, scheduled, first/last token, finished) from the engine
core's events, offline: in order for every request, and a preempted request keeps its first scheduling and
counts its preemptions as the scheduler does."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from pagedllm import LLM, SamplingParams


def test_timeline_in_order_and_preemptions_counted(tiny_root: Path) -> None:
    # 8 blocks of 4 tokens for 3 requests that each grow to 18 tokens: the pool runs out mid-decode.
    llm = LLM(make_tiny_model("llama", tiny_root), num_threads=1, block_size=4, num_kv_blocks=8,
              admission_headroom_tokens=0, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10]} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    stats = llm.get_stats()
    assert stats.num_preemptions > 0  # the setting above must preempt, or this test checks nothing
    assert sum(o.metrics.num_preemptions for o in outs if o.metrics) == stats.num_preemptions
    for out in outs:
        m = out.metrics
        assert m is not None and len(m.token_times) == 12
        assert m.queued_time is not None and m.scheduled_time is not None and m.finished_time is not None
        assert m.first_token_time is not None and m.last_token_time is not None
        assert m.arrival_time <= m.queued_time <= m.scheduled_time < m.first_token_time <= m.last_token_time
        assert m.last_token_time <= m.finished_time
        assert m.prefill_time is not None and m.decode_time is not None and m.inference_time is not None
        assert m.inference_time == pytest.approx(m.prefill_time + m.decode_time)
        assert m.time_per_output_token == m.decode_time / 11
    llm.shutdown()
