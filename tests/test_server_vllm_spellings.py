"""vLLM's spellings on `pagedllm serve` (issue 25 item 5), against a live server on the embedded model:
`serve MODEL` positional, `--chat-template FILE`, `--uvicorn-log-level`, `chat_template_kwargs` and
`continue_final_message`, `/ping` and `/version`, and every metric also under vLLM's `vllm:` names."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_server_support import LiveServer, live_server

pytestmark = pytest.mark.slow

API_KEY = "spell-key"
# The template's marker shows in the prompt's tokens, so a test can tell it replaced the model's own.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} MARKER{{ extra_var | default('') }}\n{{ m.content }}"
    "{% if not (loop.last and continue_final_message is defined and continue_final_message) %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(default_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("spellings")
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    args = [default_gguf, "--chat-template", str(template), "--uvicorn-log-level", "warning",
            "--api-key", API_KEY, "--max-model-len", "512"]
    with live_server(args, str(root / "server.log")) as srv:
        yield srv


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_chat_template_flag_and_template_kwargs(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "Hello there"}]
    tok = _post(server, "/tokenize", {"messages": msgs})
    text = _post(server, "/detokenize", {"tokens": tok.json()["tokens"]}).json()["prompt"]
    assert "user MARKER\nHello there" in text  # --chat-template replaced the model's template
    plain = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0})
    extra = _post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "temperature": 0,
                                                    "chat_template_kwargs": {"extra_var": " and more words"}})
    assert plain.status_code == extra.status_code == 200, extra.text
    # The template variable lengthened the prompt by exactly its tokens.
    assert extra.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    bad = _post(server, "/v1/chat/completions", {"messages": msgs, "chat_template_kwargs": {"tools": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_continue_final_message(server: LiveServer) -> None:
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one, two,"}]
    base = {"messages": msgs, "max_tokens": 1, "temperature": 0}
    both = _post(server, "/v1/chat/completions", {**base, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    closed = _post(server, "/v1/chat/completions", {**base, "add_generation_prompt": False})
    cont = _post(server, "/v1/chat/completions", {**base, "add_generation_prompt": False,
                                                   "continue_final_message": True})
    assert closed.status_code == cont.status_code == 200, cont.text
    # Continuing leaves the last message open: the closing <|im_end|> and newline are not in the prompt.
    assert cont.json()["usage"]["prompt_tokens"] < closed.json()["usage"]["prompt_tokens"]


def test_ping_and_version_are_open(server: LiveServer) -> None:
    assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{server.url}/ping", timeout=10).status_code == 200
    version = httpx.get(f"{server.url}/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"][0].isdigit()
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401  # the rest stays closed


def test_metrics_also_under_vllm_names(server: LiveServer) -> None:
    assert _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("num_requests_running", "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_bucket"):
        ours = [line for line in text.splitlines() if line.startswith(f"pagedllm:{name}")]
        theirs = [line for line in text.splitlines() if line.startswith(f"vllm:{name}")]
        assert ours and [line.replace("pagedllm:", "vllm:", 1) for line in ours] == theirs, name
    assert "# TYPE vllm:num_requests_running gauge" in text


def test_docs_are_served_without_a_cdn(server: LiveServer) -> None:
    """/docs and /redoc reference no other host, and every asset they reference is served here (200)."""
    import re
    from urllib.parse import urljoin, urlparse

    headers = {"Authorization": f"Bearer {API_KEY}"}
    for page in ("/docs", "/redoc"):
        r = httpx.get(f"{server.url}{page}", headers=headers, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (page, r.text[:300])
        assert not re.findall(r"https?://", r.text), (page, re.findall(r"https?://\S+", r.text))
        # src= / href= attributes and the spec URL the page's script loads (url: '...', spec-url="...").
        refs = re.findall(r"""(?:src|href|spec-url)=["']([^"']+)["']|url: ?'([^']+)'""", r.text)
        paths = {a or b for a, b in refs}
        assert any(p.endswith(".js") for p in paths) and "/openapi.json" in paths, paths
        for path in paths:
            url = urljoin(f"{server.url}{page}", path)
            assert urlparse(url).netloc == urlparse(server.url).netloc, url
            asset = httpx.get(url, headers=headers, timeout=30)
            assert asset.status_code == 200 and asset.content, (url, asset.status_code)
    bundle = httpx.get(f"{server.url}/docs/assets/swagger-ui-bundle.js", headers=headers, timeout=30)
    assert "SwaggerUIBundle" in bundle.text
    # The docs and their assets are behind the API key like every other route but the probes.
    assert httpx.get(f"{server.url}/docs", timeout=30).status_code == 401


def test_models_list_names_the_root_as_vllm_does(server: LiveServer, default_gguf: str) -> None:
    """vLLM's /v1/models has `root` (the model behind the served name); its `bench serve` reads it."""
    card = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert card["data"][0]["root"] == default_gguf and card["data"][0]["max_model_len"] == 512
