"""Token-level parser for Harmony completions that reports problems as data instead of raising.

One state machine serves both the batch ``HarmonyFormat.parse`` and the incremental
:class:`StreamingParser`. It walks the completion token by token (what the model sampled after the prompt's
``<|start|>assistant``)::

    [header] <|message|> content (<|end|> | <|call|> | <|return|>)
    [<|start|> assistant header <|message|> content terminator] ...

A header holds an optional ``to=RECIPIENT``, ``<|channel|>CHANNEL`` and an optional content type
(``<|constrain|>json`` or a bare word such as ``code``). Header text follows the rules of openai-harmony's
own header parser; unlike it, every problem becomes a :class:`ParseError` with the offending token index.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from agentrl.harmony.types import Message, ParsedTurn, ParseError, ParseErrorKind, ToolCall, ToolSpec

VALID_CHANNELS = ("analysis", "commentary", "final")
BUILTIN_NAMESPACES = ("python", "browser", "container")


@dataclass(frozen=True)
class HarmonyTokens:
    """Ids of Harmony's formatting tokens (o200k_harmony)."""

    start: int = 200006
    end: int = 200007
    message: int = 200008
    channel: int = 200005
    constrain: int = 200003
    return_: int = 200002
    call: int = 200012
    first_special: int = 199998  # every id >= this is a special token in o200k_harmony
    max_id: int = 201088  # the encoding's largest id

    @property
    def terminators(self) -> frozenset[int]:
        return frozenset((self.end, self.call, self.return_))


class ParserState(str, Enum):
    HEADER = "header"  # collecting header tokens of the current message
    CONTENT = "content"  # after <|message|>, collecting content
    EXPECT_START = "expect_start"  # after a terminator; more output should begin with <|start|>


class _Machine:
    """The shared state machine. ``decode(ids) -> str`` renders ids (specials literally)."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], toks: HarmonyTokens, tools: Sequence[ToolSpec] | None
    ):
        self._decode = decode
        self.t = toks
        self.recipients = None if tools is None else {t.recipient for t in tools}
        self.state = ParserState.HEADER
        self.implicit_role = True  # the prompt ended with <|start|>assistant
        self.n = 0  # tokens consumed
        self.header: list[int] = []
        self.header_start = 0
        self.content: list[int] = []
        self.content_start = 0
        self.current: Message | None = None  # header of the message being read
        self.turn = ParsedTurn()
        self.last_token: int | None = None
        self._start_reported = False
        self._after_stop_reported = False

    # -- helpers -------------------------------------------------------------------------------------
    def _err(self, kind: ParseErrorKind, message: str, index: int | None) -> None:
        self.turn.errors.append(ParseError(kind, message, index))

    # -- feeding -------------------------------------------------------------------------------------
    def feed(self, tok: int) -> None:
        i = self.n
        self.n += 1
        t = self.t
        if tok < 0 or tok > t.max_id:
            self._err(ParseErrorKind.MALFORMED, f"token id {tok} is outside the vocabulary (ignored)", i)
            return
        prev, self.last_token = self.last_token, tok
        state = self.state
        if state is ParserState.CONTENT:
            if tok == t.end or tok == t.call or tok == t.return_:
                self._finish_message(tok, i)
            else:
                if tok >= t.first_special:
                    self._err(
                        ParseErrorKind.STRAY_SPECIAL,
                        f"special token {self._decode([tok])!r} inside message content (kept as text)",
                        i,
                    )
                self.content.append(tok)
        elif state is ParserState.HEADER:
            if tok == t.message:
                self._open_content(i)
            elif tok in (t.end, t.call, t.return_):
                self._err(
                    ParseErrorKind.NO_HEADER,
                    f"message ended by {self._decode([tok])!r} before any <|message|> token",
                    i,
                )
                self.header = []
                self.state = ParserState.EXPECT_START
            elif tok == t.start or (tok >= t.first_special and tok not in (t.channel, t.constrain)):
                self._err(
                    ParseErrorKind.STRAY_SPECIAL, f"special token {self._decode([tok])!r} inside a header", i
                )
            else:
                if not self.header:
                    self.header_start = i
                self.header.append(tok)
        else:  # EXPECT_START
            if (prev == t.call or prev == t.return_) and not self._after_stop_reported:
                self._err(
                    ParseErrorKind.MALFORMED,
                    "output continues after the stop token (<|call|> or <|return|>); parsed anyway",
                    i,
                )
                self._after_stop_reported = True
            if tok == t.start:
                self.state = ParserState.HEADER
                self.implicit_role = False
                self.header = []
                self.header_start = i + 1
            else:
                if not self._start_reported:
                    self._err(ParseErrorKind.NO_HEADER, "a new message must begin with <|start|>", i)
                    self._start_reported = True
                self.state = ParserState.HEADER
                self.implicit_role = True
                self.header = []
                self.n -= 1  # re-read this token as the start of a header
                self.last_token = prev
                self.feed(tok)

    def _open_content(self, i: int) -> None:
        self.current = self._parse_header(i)
        self.content = []
        self.content_start = i + 1
        self.state = ParserState.CONTENT

    def _parse_header(self, i: int) -> Message:
        """Header tokens -> Message skeleton (content filled later); problems become errors."""
        text = self._decode(self.header)
        idx = self.header_start
        channel = None
        marker = "<|channel|>"
        pos = text.find(marker)
        if pos >= 0:
            after = text[pos + len(marker) :]
            stop = next((k for k, c in enumerate(after) if c.isspace() or c == "<"), len(after))
            channel = after[:stop] or None
            text = text[:pos] + " " + after[stop:]
        text = text.replace("<|constrain|>", " <|constrain|>")
        parts = text.split()
        role = "assistant"
        if not self.implicit_role:
            if not parts:
                self._err(ParseErrorKind.NO_HEADER, "message header after <|start|> has no role", idx)
            else:
                role = parts.pop(0)
                if role != "assistant":
                    self._err(
                        ParseErrorKind.MALFORMED,
                        f"the model wrote a message as {role!r}; only 'assistant' messages are valid in a completion",
                        idx,
                    )
        recipient = content_type = None
        extra: list[str] = []
        for part in parts:
            if part.startswith("to=") and recipient is None:
                recipient = part[3:] or None
            elif part.startswith("<|constrain|>") and content_type is None:
                content_type = part[len("<|constrain|>") :] or None
            elif content_type is None and recipient is not None:
                content_type = part
            else:
                extra.append(part)
        if extra:
            self._err(
                ParseErrorKind.MALFORMED, f"unexpected text in message header: {' '.join(extra)!r}", idx
            )
        if channel is None:
            self._err(ParseErrorKind.MALFORMED, "message header has no <|channel|>; Harmony requires one", i)
        elif channel not in VALID_CHANNELS:
            self._err(
                ParseErrorKind.MALFORMED,
                f"unknown channel {channel!r}; valid channels are {', '.join(VALID_CHANNELS)}",
                idx,
            )
        if recipient in ("all", "assistant"):
            recipient = None
        return Message(role=role, content="", channel=channel, recipient=recipient, content_type=content_type)

    def _finish_message(self, tok: int, i: int) -> None:
        msg = self.current
        assert msg is not None
        msg.content = self._decode(self.content)
        self.turn.messages.append(msg)
        self._interpret(msg, self.content_start)
        self.current = None
        self.content = []
        self.state = ParserState.EXPECT_START

    def _interpret(self, msg: Message, index: int) -> None:
        """Turn a complete message into a final answer or a tool call, checking the call."""
        if msg.recipient is None:
            if msg.channel == "final":
                self.turn.final = msg.content
            return
        recipient = msg.recipient
        namespace, _, tail = recipient.partition(".")
        builtin = namespace in BUILTIN_NAMESPACES
        if msg.channel == "analysis" and not builtin:
            self._err(
                ParseErrorKind.CALL_IN_ANALYSIS,
                f"call to {recipient!r} in the analysis channel; function calls must use the commentary channel",
                index,
            )
            return
        if self.recipients is not None and recipient not in self.recipients:
            known = ", ".join(sorted(self.recipients)) or "none"
            self._err(
                ParseErrorKind.UNKNOWN_RECIPIENT,
                f"call to unknown tool {recipient!r} (declared: {known})",
                index,
            )
            return
        if namespace == "python" and not tail:
            args: object = {"code": msg.content}
        else:
            try:
                args = json.loads(msg.content)
            except ValueError as exc:
                self._err(
                    ParseErrorKind.BAD_JSON, f"arguments for {recipient!r} are not valid JSON: {exc}", index
                )
                return
            if not isinstance(args, dict):
                self._err(
                    ParseErrorKind.BAD_JSON,
                    f"arguments for {recipient!r} must be a JSON object, got {type(args).__name__}",
                    index,
                )
                return
        self.turn.tool_calls.append(
            ToolCall(
                recipient=recipient,
                name=tail or namespace,
                arguments=args,  # type: ignore[arg-type]
                raw_arguments=msg.content,
                channel=msg.channel,
            )
        )

    def finish(self) -> ParsedTurn:
        """End of completion: flag truncation / emptiness and return the ParsedTurn."""
        turn = self.turn
        if self.n == 0:
            self._err(ParseErrorKind.EMPTY, "the completion is empty", None)
            return turn
        if self.state is ParserState.EXPECT_START:
            turn.stop_token = self.last_token  # <|end|>, <|call|> or <|return|>
        else:
            if self.state is ParserState.CONTENT and self.current is not None:
                self.current.content = self._decode(self.content)
                turn.messages.append(self.current)
            self._err(
                ParseErrorKind.TRUNCATED,
                "generation stopped without a stop token (token limit?); the last message is incomplete",
                self.n,
            )
        if not turn.messages and not any(e.kind is ParseErrorKind.TRUNCATED for e in turn.errors):
            self._err(ParseErrorKind.EMPTY, "the completion contains no message", None)
        return turn


def parse_harmony(
    ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    tools: Sequence[ToolSpec] | None = None,
    toks: HarmonyTokens = HarmonyTokens(),
) -> ParsedTurn:
    """Parse one completion; see :meth:`HarmonyFormat.parse` for the contract."""
    m = _Machine(decode, toks, tools)
    for tok in ids:
        m.feed(int(tok))
    return m.finish()


class StreamingParser:
    """Incremental Harmony parser for token-by-token generation.

    ``feed(token)`` returns the text delta the token added to the current message's content ("" for header
    and formatting tokens), decoding UTF-8 across token boundaries. ``state``, ``channel`` and ``recipient``
    describe the message being generated; ``messages`` lists the completed ones. ``finish()`` returns the
    same :class:`ParsedTurn` as ``HarmonyFormat.parse`` on the whole completion.
    """

    def __init__(self, fmt, tools: Sequence[ToolSpec] | None = None):  # fmt: HarmonyFormat
        self._fmt = fmt
        self._m = _Machine(fmt.decode, fmt.tokens, tools)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        m = self._m
        token = int(token)
        before = m.state
        m.feed(token)
        if not 0 <= token <= m.t.max_id:  # ignored by the machine (an error is recorded): adds no text
            return ""
        if before is ParserState.CONTENT and m.state is ParserState.CONTENT:
            return self._utf8.decode(self._fmt.token_bytes(token))
        if before is ParserState.CONTENT:  # message ended: flush any partial UTF-8
            tail = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            return tail
        return ""

    @property
    def state(self) -> ParserState:
        return self._m.state

    @property
    def channel(self) -> str | None:
        return self._m.current.channel if self._m.current else None

    @property
    def recipient(self) -> str | None:
        return self._m.current.recipient if self._m.current else None

    @property
    def messages(self) -> list[Message]:
        return list(self._m.turn.messages)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._m.turn.tool_calls)

    @property
    def stopped(self) -> bool:
        """True once ``<|call|>`` or ``<|return|>`` was seen: generation of this action should stop."""
        m = self._m
        return m.state is ParserState.EXPECT_START and m.last_token in (m.t.call, m.t.return_)

    def finish(self) -> ParsedTurn:
        return self._m.finish()
