"""LLM: the offline entry point, shaped like vLLM's (`LLM(model).generate(prompts, params)`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchOutput, run_searches, start_search
from pagedllm.engine.encoder_decoder_prompt import ENCODER_IDS_KEY
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.sched.stats import SchedulerStats

Message = dict[str, Any]


class LLM:
    """Generate text for a batch of prompts with continuous batching.

    `LLM()` serves the embedded default model; `LLM("path/to/model")`, `LLM(config="engine.yaml")` and
    vLLM-style keyword overrides (`max_num_seqs=8`, `block_size=16`, `enable_prefix_caching=False`, ...).
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model, config=config, **kwargs)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def engine_info(self) -> EngineInfo:
        """The engine's model, limits, KV layout and chosen components."""
        return EngineInfo.of(self.engine.parts)

    def get_stats(self) -> SchedulerStats:
        """Cumulative scheduler counters (preemptions, prefix-cache queries and hits, steps, drafts)."""
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Stop the engine (fires the engine_stopped hook once)."""
        self.engine.shutdown()

    def __del__(self) -> None:
        # NOTE: the engine core freezes its start-up objects out of the cyclic GC (engine_core.py); only
        # shutdown() unfreezes them. Without this, `del llm` would keep a CUDA engine's reference cycles -- and
        # its GPU memory -- alive for the life of the process. Shutting down twice is a no-op.
        engine = getattr(self, "engine", None)  # absent if __init__ failed
        if engine is not None:
            # A bare try, not contextlib.suppress: at interpreter teardown this module's globals (contextlib
            # included) may already be None.
            try:  # noqa: SIM105
                engine.shutdown()
            except Exception:  # noqa: S110 (nothing to report to at teardown)
                pass

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Raises ValueError, before anything runs, for a prompt the engine can never run (empty, token ids
        outside the vocabulary, no room left in the context) or params it cannot honour (token ids outside
        the vocabulary, ...), as vLLM's LLM.generate does.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        # Only finished outputs are returned, so ask the engine for nothing else (vLLM does the same).
        final_only: dict[int, SamplingParams] = {}
        for params in params_list:
            if id(params) not in final_only:
                final_only[id(params)] = params.clone()
                final_only[id(params)].output_kind = RequestOutputKind.FINAL_ONLY
        params_list = [final_only[id(p)] for p in params_list]
        builder = self.engine.requests
        checked: list[PromptType] = []
        for prompt, params in zip(prompt_list, params_list):
            # Tokenized once here, so the checks see what the engine will run (after truncation).
            decoder_prompt, encoder_ids = builder.split_prompt(prompt)  # (prompt, None): decoder-only
            text, ids = builder.tokenize(decoder_prompt)
            ids = builder.truncate(ids, params)
            builder.validate_params(params)
            builder.validate_prompt(ids)
            checked.append({"prompt": text, "prompt_token_ids": ids} if encoder_ids is None else
                           {"prompt": text, "prompt_token_ids": ids, ENCODER_IDS_KEY: encoder_ids})
        order: dict[str, int] = {}
        try:
            for prompt, params in zip(checked, params_list):
                rid = str(next(self._ids))
                order[rid] = len(order)
                self.engine.add_request(rid, prompt, params)
        except BaseException:
            self.engine.abort_request(list(order))  # nothing half-submitted stays queued
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (with `tools`, OpenAI tool objects, rendered
        by it as vLLM's `LLM.chat(tools=...)` does), then generate."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            ids = tok.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True, chat_template=chat_template,
                tools=tools,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's LLM.beam_search): the best `params.beam_width` sequences of each prompt, best
        first, in input order. Each step runs every prompt's live beams as one-token requests, batched together
        (beam_search.py says how beams are ranked and share KV blocks).

        Raises ValueError, before anything runs, for a prompt that leaves no room for max_tokens.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list: list[PromptType] = list(prompts)  # type: ignore[arg-type]
        builder = self.engine.requests
        searches = [start_search(builder, p, params) for p in prompt_list]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=params.max_tokens, desc="Beam search steps", dynamic_ncols=True)

        def run_step(token_lists: list[list[int]], step_params: SamplingParams) -> list[RequestOutput]:
            order: dict[str, int] = {}
            try:
                for ids in token_lists:
                    rid = str(next(self._ids))
                    order[rid] = len(order)
                    self.engine.add_request(rid, {"prompt_token_ids": ids}, step_params)
            except BaseException:
                self.engine.abort_request(list(order))
                raise
            if bar is not None:
                bar.update(1)
            return self._run(order, use_tqdm=False)

        try:
            run_searches(searches, run_step)
        finally:
            if bar is not None:
                bar.close()
        return [s.output(self.get_tokenizer()) for s in searches]

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(results) < len(order) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        missing = [rid for rid in order if rid not in results]
        if missing:  # never drop a request silently
            raise RuntimeError(f"engine stopped with requests unfinished: {missing}")
        return [results[rid] for rid in sorted(results, key=order.__getitem__)]

    @staticmethod
    def texts(outputs: list[RequestOutput]) -> list[str]:
        return [o.outputs[0].text for o in outputs]


