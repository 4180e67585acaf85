"""`use_beam_search` on /v1/completions through the official `openai` client: the choices are the offline
`LLM.beam_search` beams (n = beam width; best first, index = prompt * n + rank); a stream, a field beam search
cannot honour, and length_penalty without beam search are 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
openai = pytest.importorskip("openai")

from structured_models import tiny_model_with_tokenizer  # noqa: E402
from test_server_support import LiveServer, live_server  # noqa: E402

MODEL = "tiny-beams"
PROMPTS = ["The weather today is", "Once upon a time"]
WIDTH, MAX_TOKENS = 4, 6

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("beam-server"))


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with live_server(["--model", model_dir, "--served-model-name", MODEL, "--max-model-len", "256"], str(log)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir: str) -> list[Any]:
    from pagedllm import LLM
    from pagedllm.sampling_params import BeamSearchParams

    llm = LLM(model_dir, device="cpu", max_model_len=256, num_threads=1)
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS)
    outputs = llm.beam_search(PROMPTS, params)
    # The last 2 prompt tokens, for truncate_prompt_tokens=2.
    _, ids = llm.engine.tokenize(PROMPTS[0])
    outputs += llm.beam_search([ids[-2:]], params)
    llm.shutdown()
    return outputs


def test_beam_search_equals_offline(client: Any, offline: list[Any]) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, n=WIDTH, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"use_beam_search": True})
    got = [(c.index, c.text, c.finish_reason) for c in resp.choices]
    want = [(i * WIDTH + r, s.text, s.finish_reason) for i, out in enumerate(offline[:2])
            for r, s in enumerate(out.sequences)]
    assert got == want
    assert len({c.text for c in resp.choices[:WIDTH]}) == WIDTH  # distinct beams, not one answer repeated
    assert resp.usage.completion_tokens == sum(len(s.generated) for out in offline[:2] for s in out.sequences)


def test_truncate_prompt_tokens_keeps_the_end(client: Any, offline: list[Any]) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=WIDTH, max_tokens=MAX_TOKENS,
                                     extra_body={"use_beam_search": True, "truncate_prompt_tokens": 2})
    assert [c.text for c in resp.choices] == [s.text for s in offline[2].sequences]
    assert resp.usage.prompt_tokens == 2
    assert [s.text for s in offline[2].sequences] != [s.text for s in offline[0].sequences]  # truncation shows


@pytest.mark.parametrize(("extra", "param"), [
    ({"use_beam_search": True, "stream": True}, "stream"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "best_of": 4}, "best_of"),  # vLLM V1 dropped it; an unknown field here
    ({"length_penalty": 0.5}, "length_penalty"),  # beam search's only
], ids=["stream", "top_p", "logprobs", "best_of", "length_penalty_alone"])
def test_refused_with_the_field_named(client: Any, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], n=WIDTH, max_tokens=MAX_TOKENS, extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
