"""`pagedllm chat` as a person uses it: a real process on a pseudo-terminal (pexpect), the embedded SmolLM2.

One chat process serves the module (its start-up is most of the time); each test starts from `/clear`.
The context is 512 tokens and replies are capped at 128, so a few long messages outgrow it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

PROMPT = "\r\n> "
STORY = "Write a long story about a dragon."  # greedy SmolLM2 writes past 128 tokens for this
MAX_TOKENS = 128
CONTEXT = 512


def _filler(word: str, n: int) -> str:
    return f"Remember these words: {' '.join([word, 'river', 'stone', 'cloud'] * n)}"


@pytest.fixture(scope="module")
def chat(default_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[pexpect.spawn]:
    exe = shutil.which("pagedllm", path=str(Path(sys.executable).parent))
    assert exe, "the pagedllm script is not installed next to this Python"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGEDLLM_LOG_LEVEL": "ERROR", "TERM": "xterm"}
    child = pexpect.spawn(
        exe, ["chat", "--max-tokens", str(MAX_TOKENS), "--max-model-len", str(CONTEXT), "--num-threads", "1",
              "--temperature", "0"],
        env=env, encoding="utf-8", timeout=180, dimensions=(40, 400),
        cwd=str(tmp_path_factory.mktemp("chat")),
    )
    child.expect_exact("/help lists the commands")
    child.expect_exact(PROMPT)
    yield child
    if child.isalive():
        child.terminate(force=True)


def say(child: pexpect.spawn, line: str) -> str:
    """Send a line; everything printed until the next prompt (the line's echo removed)."""
    child.sendline(line)
    child.expect_exact(line + "\r\n")
    child.expect_exact(PROMPT)
    return str(child.before)


def saved(child: pexpect.spawn, tmp_path: Path) -> list[dict[str, str]]:
    path = tmp_path / "conversation.json"
    assert "saved" in say(child, f"/save {path}")
    return list(json.loads(path.read_text()))


def test_reply_streams_before_it_ends(chat: pexpect.spawn, tmp_path: Path) -> None:
    say(chat, "/clear")
    chat.sendline(STORY)
    chat.expect_exact(STORY + "\r\n")
    first = str(chat.read_nonblocking(100_000, timeout=120))  # whatever has arrived by now
    chat.expect_exact(PROMPT)
    rest = str(chat.before)
    assert first.strip(), "the first read had no text"
    assert PROMPT not in first, f"the whole reply came at once: {first!r}"
    assert f"cut at {MAX_TOKENS} tokens" in rest  # the reply ran to max_tokens: long enough to stream
    reply = (first + rest).split("\r\n[the reply was cut")[0]
    assert len(first) < len(reply) / 2, f"the first read held {len(first)} of {len(reply)} characters"
    # What was shown is what the conversation keeps.
    messages = saved(chat, tmp_path)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"].replace("\n", "\r\n").strip() == reply.strip()


def test_ctrl_c_stops_the_reply_and_keeps_the_session(chat: pexpect.spawn, tmp_path: Path) -> None:
    say(chat, "/clear")
    say(chat, "My name is Zorblax.")
    chat.sendline(STORY)
    chat.expect_exact(STORY + "\r\n")
    shown = str(chat.read_nonblocking(100_000, timeout=120))
    chat.sendintr()
    chat.expect_exact("[stopped (the partial reply stays in the conversation)]")
    shown += str(chat.before)
    chat.expect_exact(PROMPT)
    assert chat.isalive()
    # The session goes on, with its history: the model still knows the name from before the stop.
    assert "Zorblax" in say(chat, "What is my name?")
    messages = saved(chat, tmp_path)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    partial = messages[3]["content"]
    assert messages[2]["content"] == STORY
    assert partial.strip() and partial.replace("\n", "\r\n").strip() in shown
    # Stopped early: far short of the 128-token reply the story runs to (test above).
    assert len(partial) < 250, partial


def test_ctrl_c_at_the_prompt_keeps_the_session(chat: pexpect.spawn, tmp_path: Path) -> None:
    say(chat, "/clear")
    say(chat, "My name is Zorblax.")
    chat.sendintr()
    chat.expect_exact(PROMPT)
    assert "Zorblax" in say(chat, "What is my name?")


def test_outgrown_history_drops_the_oldest_turns_and_keeps_the_system_prompt(
    chat: pexpect.spawn, tmp_path: Path
) -> None:
    say(chat, "/clear")
    assert "system prompt set" in say(chat, "/system You are a helpful assistant named Nemo.")
    # Each message is about 105 tokens, each reply up to 128: the third leaves no room for 128 more.
    first, second, third = (_filler(w, 25) for w in ("apple", "mango", "peach"))
    for message in (first, second):
        assert "dropped" not in say(chat, message)
    out = say(chat, third)
    assert f"outgrew the {CONTEXT}-token context: its 2 oldest messages were dropped" in out
    assert "(the system prompt stays)" in out
    messages = saved(chat, tmp_path)
    assert messages[0] == {"role": "system", "content": "You are a helpful assistant named Nemo."}
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == [second, third]  # the oldest exchange went, the later ones stayed, in order
    assert messages[-1]["role"] == "assistant" and messages[-1]["content"].strip()


def test_a_message_that_cannot_fit_is_refused_and_nothing_changes(chat: pexpect.spawn, tmp_path: Path) -> None:
    say(chat, "/clear")
    say(chat, "/system You are a helpful assistant.")
    say(chat, "My name is Zorblax.")
    before = saved(chat, tmp_path)
    out = say(chat, _filler("apple", 120))  # about 500 tokens: more than the 512 - 128 a prompt may take
    assert "this message does not fit" in out and "Nothing was sent" in out
    assert f"the reply may take {MAX_TOKENS} tokens (--max-tokens)" in out
    assert f"the context holds {CONTEXT} (--max-model-len)" in out
    assert saved(chat, tmp_path) == before
    assert "Zorblax" in say(chat, "What is my name?")


def test_clear_system_save_and_help(chat: pexpect.spawn, tmp_path: Path) -> None:
    say(chat, "/clear")
    help_text = say(chat, "/help")
    for command in ("/help", "/clear", "/system", "/save FILE", "/exit"):
        assert command in help_text
    say(chat, "/system Always answer in French.")
    assert "system prompt: 'Always answer in French.'" in say(chat, "/system")
    say(chat, "Hello!")
    assert "conversation cleared (2 messages forgotten; the system prompt stays)" in say(chat, "/clear")
    assert saved(chat, tmp_path) == [{"role": "system", "content": "Always answer in French."}]
    assert "could not save to" in say(chat, f"/save {tmp_path / 'missing' / 'x.json'}")
    assert "usage: /save FILE" in say(chat, "/save")
    assert "unknown command /bogus" in say(chat, "/bogus")
    assert saved(chat, tmp_path) == [{"role": "system", "content": "Always answer in French."}]


def test_ctrl_d_quits_with_exit_code_0(chat: pexpect.spawn) -> None:
    chat.sendeof()
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
