"""Beam search on top of the engine, as vLLM builds it: every step, each live beam is a one-token request.

A search never reaches into the scheduler or the model runner. Each step it submits every live beam's tokens
(prompt + generated so far) as a request for one token with `logprobs=K`, ranks the returned candidates by
cumulative logprob, and keeps the best `beam_width`. The prefix cache makes this cheap: a beam's prompt is its
parent's plus one token, so every full KV block of it is a cache hit -- shared by reference count between the
beams that descend from it -- and only the partially filled last block is recomputed (there is no
copy-on-write of that block; docs/sampling.md, "Beam search").

The ranking follows transformers' `generate(num_beams=W, early_stopping=True, do_sample=False)` so the
sequences equal its (tests/test_beam_search.py); NOTE(1)-(3) are where that differs from vLLM's LLM.beam_search.

    step:   live beams (<= W, same length g)  ->  K = max(2, 1 + #EOS ids) * W candidates of each
            pool = every (beam, token) candidate, scored cum_logprob(beam) + logprob(token); the top K of it:
                rank < W and (token is EOS or g + 1 == max_tokens)  ->  finished, score = cum / (g + 1) ** lp
                otherwise, not finishing                             ->  the next live beams (the first W)
            done when W beams have finished (early_stopping=True) or max_tokens is reached

NOTE(1) only a finishing candidate ranked among the step's top W may finish (transformers); vLLM finishes every
EOS among each beam's top 2W, so a weak EOS continuation can end up among its results.
NOTE(2) the search stops once W beams have finished (early_stopping=True); vLLM runs to max_tokens and then
ranks the finished beams together with the live ones.
NOTE(3) the length penalty divides by the generated length, EOS included (transformers); vLLM divides by the
prompt and generated length, EOS excluded. With length_penalty=1.0 this changes which of two finished beams of
different lengths ranks first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.engine.input_processing import RequestBuilder, RequestValidationError
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.engine.llm_engine import PromptType


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): `tokens` holds the prompt and the generated tokens; `logprobs` one dict of
    candidates (token id -> Logprob, the chosen token among them) per generated token; `text` (the generated
    text) is filled when the search returns it."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    # cum_logprob / generated_len ** length_penalty (NOTE 3): what the returned beams are ordered by.
    score: float | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best `beam_width` finished beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: the live beams, the finished ones, and how a step's candidates advance them."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        self.params = params
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        # transformers keeps (1 + #EOS) * W candidates (at least 2W): even if every beam's best continuation is
        # an EOS, W non-finishing ones remain to continue the search.
        self.num_candidates = max(2, 1 + len(eos_token_ids)) * params.beam_width
        self.beams = [BeamSearchSequence(list(prompt_ids), num_prompt_tokens=len(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.done = False

    def step_params(self) -> SamplingParams:
        """Each live beam's request: one token, with the top `num_candidates` logprobs."""
        p = self.params
        return SamplingParams(
            temperature=p.temperature, max_tokens=1, logprobs=self.num_candidates, ignore_eos=True,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def advance(self, candidates: Sequence[dict[int, Logprob]]) -> None:
        """Take each live beam's candidates (token id -> logprob, in `self.beams` order) one token further."""
        assert not self.done and len(candidates) == len(self.beams)
        width, max_tokens = self.params.beam_width, self.params.max_tokens
        new_len = len(self.beams[0].generated) + 1
        pool = [
            (beam.cum_logprob + lp.logprob, b, token)
            for b, (beam, cands) in enumerate(zip(self.beams, candidates))
            for token, lp in cands.items()
        ]
        # Ties broken by (beam, token), the order of transformers' flattened beam-major topk.
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        at_limit = new_len >= max_tokens
        live: list[BeamSearchSequence] = []
        for rank, (cum, b, token) in enumerate(pool[: self.num_candidates]):
            parent, cands = self.beams[b], candidates[b]
            ends = token in self.eos
            if not (ends or at_limit):
                if len(live) < width:
                    live.append(self._child(parent, token, cands, cum))
            elif rank < width:  # NOTE 1
                child = self._child(parent, token, cands, cum)
                child.finish_reason = "stop" if ends else "length"
                child.score = cum / (new_len**self.params.length_penalty)  # NOTE 3
                self.finished.append(child)
        self.finished.sort(key=lambda s: -(s.score or 0.0))
        del self.finished[width:]
        self.beams = live
        self.done = at_limit or not live or len(self.finished) >= width  # NOTE 2

    @staticmethod
    def _child(parent: BeamSearchSequence, token: int, cands: dict[int, Logprob], cum: float) -> BeamSearchSequence:
        # Every candidate of the step is kept, as vLLM's beams keep them: the chosen token's logprob among them.
        return BeamSearchSequence(
            parent.tokens + [token], parent.logprobs + [cands], cum, num_prompt_tokens=parent.num_prompt_tokens,
        )

    def output(self, tokenizer: Any | None) -> BeamSearchOutput:
        """The finished beams, best first, with their text (EOS left out unless include_stop_str_in_output)."""
        assert self.done
        for seq in self.finished:
            ids = seq.generated
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                ids = ids[:-1]
            if tokenizer is not None:
                seq.text = str(tokenizer.decode(ids, skip_special_tokens=not self.params.include_stop_str_in_output))
        return BeamSearchOutput(list(self.finished))


def start_search(builder: RequestBuilder, prompt: PromptType, params: BeamSearchParams) -> BeamSearch:
    """A search for `prompt`, or RequestValidationError (naming the parameter) for one the engine could never
    run to max_tokens: every step's request must fit the context."""
    if builder.limits.encoder_decoder is not None:
        # Each step here is a fresh decoder-only request of the beam's tokens: an encoder prompt would be lost.
        raise RequestValidationError("beam search is not supported for encoder-decoder models yet", "use_beam_search")
    _, ids = builder.tokenize(prompt)
    builder.validate(ids, SamplingParams(max_tokens=params.max_tokens))
    return BeamSearch(ids, params, builder.limits.eos_token_ids)


def candidates_of(out: RequestOutput) -> dict[int, Logprob]:
    """A finished one-token request's candidates; an engine that returned none failed the beam."""
    if out.error:
        raise RuntimeError(f"the engine failed a beam-search step: {out.error}")
    sample = out.outputs[0]
    if not sample.logprobs:
        raise RuntimeError(f"a beam-search step returned no logprobs (finish_reason={sample.finish_reason!r})")
    return sample.logprobs[0]


RunStep = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


def run_searches(searches: list[BeamSearch], run_step: RunStep) -> None:
    """Drive every search to the end; `run_step(prompts, params)` runs one-token requests, outputs in order.

    The live beams of all prompts go to the engine together, so one engine step batches them all."""
    while True:
        live = [s for s in searches if not s.done]
        if not live:
            return
        # Every search has the same step params but for the candidate count (the same for every prompt).
        outs = run_step([b.tokens for s in live for b in s.beams], live[0].step_params())
        at = 0
        for s in live:
            n = len(s.beams)
            s.advance([candidates_of(o) for o in outs[at: at + n]])
            at += n


async def beam_search_async(
    engine: AsyncLLM, prompt: PromptType, params: BeamSearchParams, request_id: str
) -> BeamSearchOutput:
    """One prompt's beam search on the async engine (the server's); each step's beams run concurrently.

    Raises RequestValidationError before anything runs for a prompt or max_tokens the context cannot hold."""
    search = start_search(engine.requests, prompt, params)
    step_params = search.step_params()
    step = 0
    while not search.done:
        outs = await asyncio.gather(*(
            _last_output(engine, {"prompt_token_ids": beam.tokens}, step_params, f"{request_id}-s{step}-b{i}")
            for i, beam in enumerate(search.beams)
        ))
        search.advance([candidates_of(o) for o in outs])
        step += 1
    return search.output(engine.tokenizer)


async def _last_output(engine: AsyncLLM, prompt: PromptType, params: SamplingParams, rid: str) -> RequestOutput:
    last: RequestOutput | None = None
    logprobs: list[dict[int, Logprob]] = []
    async for out in engine.generate(prompt, params, rid):
        last = out
        if out.outputs and out.outputs[0].logprobs:
            logprobs.extend(out.outputs[0].logprobs)  # the stream hands out deltas
    if last is None:
        raise RuntimeError("a beam-search step ended without an output")
    if last.outputs:
        last.outputs[0].logprobs = logprobs
    return last


__all__ = [
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "beam_search_async",
    "run_searches",
    "start_search",
]
