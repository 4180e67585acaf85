"""A `pagedllm chat` conversation: the system prompt, the turns so far, and fitting them into the context.

Fitting (`ChatSession.fit`): the prompt for the next reply is the system prompt, the turns and the new user
message through the chat template; it must leave `reply_tokens` (the reply's max_tokens) of the context free,
as the engine refuses a request whose prompt plus max_tokens exceeds max_model_len. When it does not fit, the
oldest exchanges (a user message and its reply, together, so the conversation still opens with a user turn)
are dropped one at a time; the system prompt is never dropped. When even the system prompt and the new
message alone leave no room, nothing is dropped and ContextFullError says what to shorten.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

Message = dict[str, str]
# Messages -> prompt token ids, through the model's chat template (with the generation prompt).
Render = Callable[[list[Message]], list[int]]


class ContextFullError(ValueError):
    """The new message cannot fit in the context even with every earlier turn dropped."""


@dataclass(frozen=True)
class Fitted:
    prompt_ids: list[int]
    dropped: int  # messages dropped from the front of the history to make room (always whole exchanges)


@dataclass
class ChatSession:
    system: str | None = None
    # user, assistant, user, assistant, ...: always appended as whole exchanges (add_exchange).
    turns: list[Message] = field(default_factory=list)

    def messages(self, *extra: Message) -> list[Message]:
        """What the model sees: the system prompt (if any), the turns, then `extra`."""
        return self.messages_from(0, *extra)

    def clear(self) -> int:
        """Forget the turns (the system prompt stays); how many messages were forgotten."""
        n = len(self.turns)
        self.turns.clear()
        return n

    def add_exchange(self, user: str, assistant: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]

    def fit(self, user: str, render: Render, max_model_len: int, reply_tokens: int) -> Fitted:
        """The prompt for a reply to `user`, dropping the oldest exchanges (from the session too) until the
        prompt plus `reply_tokens` fits in `max_model_len`; ContextFullError when nothing makes it fit."""
        new = {"role": "user", "content": user}
        ids: list[int] = []
        for start in range(0, len(self.turns) + 1, 2):
            ids = render(self.messages_from(start, new))
            if len(ids) + reply_tokens <= max_model_len:
                del self.turns[:start]
                return Fitted(ids, start)
        system = " (with the system prompt)" if self.system else ""
        raise ContextFullError(
            f"this message does not fit: alone{system} it makes a {len(ids)}-token prompt, the reply may take "
            f"{reply_tokens} tokens (--max-tokens), and the context holds {max_model_len} (--max-model-len). "
            "Nothing was sent and "
            "the conversation is unchanged: shorten the message"
            + (" or the system prompt (/system TEXT)" if self.system else "")
            + ", lower --max-tokens, or raise --max-model-len."
        )

    def messages_from(self, start: int, *extra: Message) -> list[Message]:
        """messages(), without the first `start` turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns[start:], *extra]

    def save(self, path: str | Path) -> int:
        """Write the conversation as a JSON list of OpenAI chat messages (what `messages` takes); the count."""
        messages = self.messages()
        Path(path).write_text(json.dumps(messages, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        return len(messages)
