"""The web UI served by `pagedllm serve`, driven in headless Chromium (Playwright's Python API, the system's
chromium binary) against a live server: a streamed chat reply, stop, regenerate, conversations kept across a
reload, and the engine dashboard's counters moving under a load.

References nobody here wrote: the official `openai` client's answer to the same messages (greedy) is the text
the page must have streamed; the server's own /metrics says a stopped reply was aborted. Screenshots go to the
test's tmp dir, and with PAGEDLLM_UPDATE_SCREENSHOTS=1 to docs/images/ as well (README shows them). The
embedded SmolLM2 serves.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")
openai = pytest.importorskip("openai")
sync_api = pytest.importorskip("playwright.sync_api")

from test_server_support import LiveServer, live_server, metric  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")

API_KEY = "sk-web-ui-test"
UPDATE_SCREENSHOTS = os.environ.get("PAGEDLLM_UPDATE_SCREENSHOTS") == "1"
DOCS_IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
# The lengths the page's latest assistant reply went through, and its state at each change: a page that
# only painted the finished reply would record one length.
RECORD_LENGTHS = """() => {
  window.__lengths = [];
  const seen = () => {
    const all = document.querySelectorAll('.message.assistant');
    const last = all[all.length - 1];
    if (last) window.__lengths.push([last.textContent.length, last.dataset.state]);
  };
  new MutationObserver(seen).observe(document.getElementById('messages'),
                                     {subtree: true, childList: true, characterData: true, attributes: true});
}"""


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> str:
    """The embedded SmolLM2, as a user's first `pagedllm serve` runs it (and it answers sensibly, so the
    screenshots show a real conversation)."""
    return str(request.getfixturevalue("default_gguf"))


@pytest.fixture(scope="module")
def server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--model", model, "--served-model-name", "webui-model", "--api-key", API_KEY, "--max-model-len", "1024",
            "--max-num-seqs", "8", "--enable-prefix-caching"]
    with live_server(args, str(log)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


def _shot(page: Any, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"))
    if UPDATE_SCREENSHOTS:
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOCS_IMAGES / f"{name}.png"))


def _open(browser: Any, server: LiveServer, fragment: str = "") -> Any:
    # bypass_csp: Playwright's wait_for_function evaluates strings, which the page's CSP (rightly) forbids.
    page = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True).new_page()
    page.errors = []  # uncaught exceptions in the page's scripts: each test ends asserting there were none
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    page.goto(f"{server.url}/{fragment}")
    # /v1/models answers 401 without the key: the page asks for it.
    page.wait_for_selector("#key-dialog:not([hidden])", timeout=10_000)
    page.fill("#key-input", API_KEY)
    page.click("#key-form button[type=submit]")
    return page


def _conversation(page: Any) -> dict[str, Any]:
    conversations = json.loads(page.evaluate("localStorage.getItem('pagedllm.conversations')"))
    return dict(conversations[0])


def test_key_guards_data_not_page(server: LiveServer) -> None:
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "<script" in page.text and "cdn" not in page.text.lower()
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name in ("chat.js", "dashboard.js", "markdown.js", "common.js", "style.css"):
        assert httpx.get(f"{server.url}/ui/static/{name}", timeout=10).status_code == 200, name
    events = httpx.get(f"{server.url}/ui/events", timeout=10)
    assert events.status_code == 401 and events.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/ui/static/nope.js", timeout=10).status_code == 401  # not a shipped file
    hello = _hello(server)
    assert hello["model"] == "webui-model" and hello["num_blocks"] > 1 and hello["block_size"] > 0


def _hello(server: LiveServer) -> dict[str, Any]:
    """The event stream's first event: the engine core's own figures (its Ready message)."""
    with httpx.stream("GET", f"{server.url}/ui/events", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=10) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        assert next(lines) == "event: hello"
        return dict(json.loads(next(lines).removeprefix("data: ")))


def test_chat_streams_stops_and_regenerates(server: LiveServer, browser: Any, tmp_path: Path) -> None:
    page = _open(browser, server)
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    assert page.eval_on_selector("#model", "s => s.value") == "webui-model"
    system = "You are a concise assistant."
    question = ("Write a Python function that reverses a string, with a one-line explanation."
                if UPDATE_SCREENSHOTS else "Hello! Tell me about paged attention.")
    max_tokens = 160 if UPDATE_SCREENSHOTS else 120
    page.fill("#system-prompt", system)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.evaluate(RECORD_LENGTHS)
    page.fill("#prompt", question)
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-state=done]", timeout=120_000)
    lengths = page.evaluate("window.__lengths")
    streaming = sorted({n for n, state in lengths if state == "streaming" and n > 0})
    assert len(streaming) >= 3, f"the reply did not grow while streaming: {lengths[:20]}"
    reply = _conversation(page)["messages"][-1]
    assert reply["role"] == "assistant" and reply["state"] == "done" and reply["content"]

    # The official client, greedy, same messages and settings: the text the page streamed.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    expected = client.chat.completions.create(
        model="webui-model", temperature=0, top_p=0.95, max_tokens=max_tokens,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    ).choices[0].message.content
    assert reply["content"] == expected
    _shot(page, tmp_path, "chat")

    # Regenerate resends the same conversation: greedy, the same reply again, now the last one.
    page.click("#regenerate")
    page.wait_for_function("document.querySelectorAll('.message.assistant').length === 1 && "
                           "document.querySelector('.message.assistant').dataset.state === 'done'", timeout=120_000)
    assert _conversation(page)["messages"][-1]["content"] == expected

    # Stop: a long reply cut short; the server aborted it (its metrics say so) and the text stops growing.
    aborts_before = _aborts(server)
    page.fill("#max-tokens", "600")  # within the context left after the conversation so far
    # Greedy: this conversation's reply runs all 600 tokens (~4 s), so the stop lands mid-stream. Sampled at
    # temperature 1 the model ended its story by itself after 60-370 tokens, and on a loaded CI machine the
    # reply was once over before the stop reached the server (no abort to count).
    page.fill("#temperature", "0")
    page.fill("#prompt", "Now tell me a very long story.")
    page.click("#send")
    page.wait_for_function("(() => { const m = [...document.querySelectorAll('.message.assistant')].pop();"
                           " return m.dataset.state === 'streaming' && m.textContent.length > 20; })()",
                           timeout=60_000)
    page.click("#stop")
    page.wait_for_selector(".message.assistant[data-state=stopped]", timeout=10_000)
    stopped = _conversation(page)["messages"][-1]["content"]
    deadline = time.monotonic() + 20
    while _aborts(server) <= aborts_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _aborts(server) == aborts_before + 1
    assert _conversation(page)["messages"][-1]["content"] == stopped  # nothing arrived after the stop
    assert page.is_visible("#send") and page.is_hidden("#stop")

    # The conversation survives a reload (localStorage), with the stopped reply marked.
    page.reload()
    page.wait_for_selector(".message.assistant[data-state=stopped]", timeout=10_000)
    assert page.locator(".message.user").count() == 2
    assert page.errors == []
    page.close()


def _aborts(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("pagedllm:request_success_total{")
             and 'finished_reason="abort"' in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def _value(page: Any, selector: str) -> float:
    text = page.eval_on_selector(selector, "e => e.dataset.value")
    return float(text) if text else -1.0


def test_dashboard_moves_under_load(server: LiveServer, browser: Any, tmp_path: Path) -> None:
    page = _open(browser, server, "#dashboard")
    page.wait_for_function("document.getElementById('m-steps').dataset.value !== undefined && "
                           "document.getElementById('m-steps').dataset.value !== ''", timeout=20_000)
    steps_before = _value(page, "#m-steps")
    # Requests sharing a long prefix: the later ones hit the prefix cache and share its blocks.
    prefix = "The engine dashboard shows the paged KV cache at work. " * 12
    tokens = 160 if UPDATE_SCREENSHOTS else 96  # SmolLM2 (the README's picture): long enough to be shot mid-load
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            r = httpx.post(f"{server.url}/v1/completions", timeout=300, headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"model": "webui-model", "prompt": f"{prefix} Request {i}:", "max_tokens": tokens,
                                 "temperature": 0.8, "ignore_eos": True})
            r.raise_for_status()
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for i, t in enumerate(threads):
        t.start()
        if i == 0:
            time.sleep(0.5)  # the first one's prefix is cached before the others look it up
    page.wait_for_function("Number(document.getElementById('m-running').dataset.value) >= 2", timeout=60_000)
    page.wait_for_function("Number(document.getElementById('kv-shared').dataset.value) > 0", timeout=60_000)
    page.wait_for_function("Number(document.getElementById('m-gen-tps').dataset.value) > 0", timeout=60_000)
    if UPDATE_SCREENSHOTS:
        time.sleep(8)  # let the charts fill for the README's picture, the load still running
        page.wait_for_function("Number(document.getElementById('m-running').dataset.value) >= 2", timeout=5_000)
    _shot(page, tmp_path, "dashboard")
    for t in threads:
        t.join(300)
    assert not errors, errors
    page.wait_for_function("Number(document.getElementById('m-running').dataset.value) === 0", timeout=30_000)
    page.wait_for_function("Number(document.getElementById('kv-cached').dataset.value) > 0", timeout=10_000)
    assert _value(page, "#m-steps") > steps_before
    assert _value(page, "#m-hit") > 0
    # The engine's own counters agree that the prefix cache was hit.
    assert metric(httpx.get(f"{server.url}/metrics", timeout=10).text, "pagedllm:prefix_cache_hits_total") > 0
    kv = {name: _value(page, f"#kv-{name}") for name in ("free", "cached", "inuse", "shared")}
    blocks = page.evaluate("document.getElementById('kv-caption').textContent")
    # Every usable block (all but the null block) is drawn in exactly one state.
    assert int(blocks.split(" ")[0]) == sum(kv.values()) == _hello(server)["num_blocks"] - 1, (blocks, kv)
    assert page.errors == []
    page.close()


MARKDOWN = """# Title
Some **bold**, *italic* and `code <b>`; snake_case_name stays.
- one
- two [docs](https://example.com/a?b=1&c=2) and [bad](javascript:alert(1))

```python
print("<script>alert(1)</script>")
```
<img src=x onerror="alert(1)"> <script>alert(2)</script>"""


def test_markdown_is_rendered_and_never_injects(server: LiveServer, browser: Any) -> None:
    page = browser.new_context(bypass_csp=True).new_page()
    page.goto(f"{server.url}/")
    # The browser's own parser reads what the renderer made: only the markup it may make, nothing active.
    found = page.evaluate("""(md) => {
      const box = document.createElement('div');
      box.innerHTML = window.PagedMarkdown.render(md);
      const tags = [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase());
      return {tags: [...new Set(tags)].sort(), links: [...box.querySelectorAll('a')].map(a => a.href),
              code: box.querySelector('pre code').textContent, lang: box.querySelector('pre code').className,
              strong: box.querySelector('strong').textContent, em: [...box.querySelectorAll('em')].map(e => e.textContent),
              inline: box.querySelector('p code').textContent, text: box.textContent};
    }""", MARKDOWN)
    assert set(found["tags"]) <= {"h3", "p", "strong", "em", "code", "ul", "li", "a", "pre", "br"}, found["tags"]
    assert not {"img", "script"} & set(found["tags"])
    assert found["links"] == ["https://example.com/a?b=1&c=2"]  # the javascript: link stays text
    assert found["code"] == 'print("<script>alert(1)</script>")' and found["lang"] == "language-python"
    assert found["strong"] == "bold" and found["em"] == ["italic"] and found["inline"] == "code <b>"
    assert "snake_case_name" in found["text"] and '<img src=x onerror="alert(1)">' in found["text"]
    page.close()
