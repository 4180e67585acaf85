"""`pagedllm chat`: an interactive conversation through the model's chat template, streamed as it is written.

The engine is the one `pagedllm serve` runs (AsyncLLM, its core in its own process); the conversation lives
here (chat_session.py), each reply is streamed and stoppable (chat_reply.py). Lines starting with "/" are
commands (HELP); an input that is not a terminal (a pipe) is read the same way, without prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import TYPE_CHECKING, Any

from pagedllm.cli.chat_session import ChatSession, ContextFullError
from pagedllm.cli.engine_args import add_engine_args, engine_config_from_args
from pagedllm.cli.generate_cmd import add_sampling_args, sampling_params_from_args

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.sampling_params import SamplingParams

HELP = """\
commands:
  /help            this list
  /clear           forget the conversation (the system prompt stays)
  /system [TEXT]   set the system prompt to TEXT (the conversation stays); without TEXT, show it
  /save FILE       write the conversation to FILE as JSON (a list of OpenAI chat messages)
  /exit, /quit     leave (as does Ctrl-D)
  //TEXT           send "/TEXT" as a message
Ctrl-C stops the reply being written (what was written so far stays in the conversation); at the prompt it
clears the line. When the conversation outgrows the context, its oldest exchanges are dropped (the system
prompt stays) and a notice says so."""

PROMPT = "> "


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat", help="interactive chat, streamed (/help for commands; Ctrl-D to quit)")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run, max_tokens=256)


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = sampling_params_from_args(args)
    try:
        from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
    except ImportError as exc:  # pyzmq and msgspec come with the server extra
        print(f"error: pagedllm chat runs the engine as `pagedllm serve` does and needs its extra "
              f"(pip install \"pagedllm[server]\"): {exc}", file=sys.stderr)
        return 1
    loop = asyncio.new_event_loop()
    engine = AsyncLLM(config)
    try:
        try:
            ready = loop.run_until_complete(engine.start())
        except EngineDeadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        max_tokens = params.max_tokens
        assert max_tokens is not None  # --max-tokens always has a value
        if max_tokens >= ready.max_model_len:  # every message would be refused
            print(f"error: --max-tokens ({max_tokens}) leaves no room for a message in the "
                  f"{ready.max_model_len}-token context (--max-model-len)", file=sys.stderr)
            return 2
        chat = _Chat(engine, loop, ChatSession(system=args.system), params, max_tokens, ready.max_model_len)
        return chat.run()
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


class _Chat:
    def __init__(self, engine: AsyncLLM, loop: asyncio.AbstractEventLoop, session: ChatSession,
                 params: SamplingParams, max_tokens: int, max_model_len: int) -> None:
        self.engine, self.loop, self.session, self.params = engine, loop, session, params
        self.max_tokens, self.max_model_len = max_tokens, max_model_len
        self.interactive = sys.stdin.isatty()

    def run(self) -> int:
        if self.interactive:
            with contextlib.suppress(ImportError):  # line editing and recall (arrow keys) where readline exists
                import readline  # noqa: F401
            _note(f"{self.engine.model_name}, context {self.max_model_len} tokens, replies up to "
                  f"{self.max_tokens} tokens. /help lists the commands; Ctrl-D quits.")
        while True:
            try:
                line = input(PROMPT if self.interactive else "")
            except EOFError:
                return 0
            except KeyboardInterrupt:  # at the prompt: drop the line, as a shell does
                print()
                continue
            if line.startswith("/") and not line.startswith("//"):
                code = self.command(line)
                if code is not None:
                    return code
            elif line.strip():
                code = self.send(line[1:] if line.startswith("//") else line)
                if code is not None:
                    return code

    def command(self, line: str) -> int | None:
        """Run a /command; an exit code to leave with, or None to go on."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name == "/help":
            print(HELP)
        elif name in ("/exit", "/quit"):
            return 0
        elif name == "/clear":
            n = self.session.clear()
            _note(f"conversation cleared ({n} messages forgotten"
                  + ("; the system prompt stays" if self.session.system else "") + ")")
        elif name == "/system":
            if rest:
                self.session.system = rest
                _note("system prompt set")
            else:
                _note(f"system prompt: {self.session.system!r}" if self.session.system
                      else "no system prompt (/system TEXT sets one)")
        elif name == "/save":
            if not rest:
                _note("usage: /save FILE")
                return None
            try:
                n = self.session.save(rest)
            except OSError as exc:
                _note(f"could not save to {rest}: {exc.strerror or exc}")
            else:
                _note(f"saved {n} messages to {rest}")
        else:
            _note(f"unknown command {name}; /help lists the commands (//TEXT sends \"/TEXT\" as a message)")
        return None

    def send(self, text: str) -> int | None:
        """Answer `text`, streamed; an exit code when the engine is gone, else None."""
        from pagedllm.cli.chat_reply import ReplyFailedError, stream_reply
        from pagedllm.engine.async_llm import EngineDeadError, RequestValidationError

        try:
            fitted = self.session.fit(text, self.engine.apply_chat_template, self.max_model_len,
                                      self.max_tokens)
        except (ContextFullError, RequestValidationError) as exc:
            _note(str(exc))
            return None
        if fitted.dropped:
            _note(f"the conversation outgrew the {self.max_model_len}-token context: its {fitted.dropped} oldest "
                  "messages were dropped" + (" (the system prompt stays)" if self.session.system else ""))
        try:
            reply = stream_reply(self.loop, self.engine, fitted.prompt_ids, self.params, _write)
        except RequestValidationError as exc:
            _note(f"error: {exc}")
            return None
        except ReplyFailedError as exc:
            _note(f"\nerror: the engine failed this reply: {exc}")
            return None
        except EngineDeadError as exc:
            _note(f"\nerror: {exc}")
            return 1
        if not reply.text.endswith("\n"):
            print(flush=True)
        self.session.add_exchange(text, reply.text)
        if reply.stopped:
            _note("stopped (the partial reply stays in the conversation)")
        elif reply.finish_reason == "length":
            _note(f"the reply was cut at {self.max_tokens} tokens (--max-tokens)")
        return None


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _note(text: str) -> None:
    """Messages about the chat, not from the model: on stderr, bracketed, so a pipe's stdout is replies only."""
    sys.stdout.flush()
    print(f"[{text.strip()}]" if not text.startswith("\n") else f"\n[{text.strip()}]", file=sys.stderr, flush=True)
