"""ChatSession.fit, the policy behind `pagedllm chat`'s long histories, with a counting chat template.

The template here costs 1 token per message plus 1 per word, so every budget below is worked out by hand;
test_chat_cli.py runs the same policy through SmolLM2's real template.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.cli.chat_session import ChatSession, ContextFullError, Message


def render(messages: list[Message]) -> list[int]:
    return [0] * sum(1 + len(m["content"].split()) for m in messages)


def words(n: int) -> str:
    return " ".join(["w"] * n)


def test_fits_without_dropping_when_there_is_room() -> None:
    s = ChatSession(system=words(3))
    s.add_exchange(words(4), words(4))
    fitted = s.fit(words(4), render, max_model_len=100, reply_tokens=10)
    assert fitted.dropped == 0 and len(fitted.prompt_ids) == 4 + 5 + 5 + 5
    assert len(s.turns) == 2


def test_drops_whole_oldest_exchanges_and_keeps_the_system_prompt() -> None:
    s = ChatSession(system=words(3))  # 4 tokens
    for word in ("a", "b", "c"):
        s.add_exchange(f"{word} " + words(8), words(9))  # 10 + 10 tokens per exchange
    # system 4 + new 10 + reply 20 = 34; each exchange kept costs 20: room for one in 60.
    fitted = s.fit(words(9), render, max_model_len=60, reply_tokens=20)
    assert fitted.dropped == 4
    assert [m["content"][0] for m in s.turns if m["role"] == "user"] == ["c"]
    assert s.messages()[0] == {"role": "system", "content": words(3)}
    assert len(fitted.prompt_ids) == 4 + 20 + 10


def test_exactly_full_fits() -> None:
    s = ChatSession()
    s.add_exchange(words(9), words(9))
    assert s.fit(words(9), render, max_model_len=30 + 5, reply_tokens=5).dropped == 0
    assert s.fit(words(9), render, max_model_len=30 + 4, reply_tokens=5).dropped == 2


def test_refuses_when_the_message_alone_cannot_fit_and_changes_nothing() -> None:
    s = ChatSession(system=words(3))
    s.add_exchange(words(4), words(4))
    with pytest.raises(ContextFullError) as err:
        s.fit(words(50), render, max_model_len=60, reply_tokens=20)
    message = str(err.value)
    assert "55-token prompt" in message and "20 tokens (--max-tokens)" in message
    assert "holds 60 (--max-model-len)" in message and "Nothing was sent" in message
    assert len(s.turns) == 2  # nothing dropped for a message that was refused


def test_save_writes_openai_messages(tmp_path: Path) -> None:
    s = ChatSession(system="be brief")
    s.add_exchange("hi", "héllo")
    assert s.save(tmp_path / "c.json") == 3
    assert json.loads((tmp_path / "c.json").read_text(encoding="utf-8")) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "héllo"},
    ]
    assert s.clear() == 2 and s.messages() == [{"role": "system", "content": "be brief"}]
