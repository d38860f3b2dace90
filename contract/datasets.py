"""What a line of training data must be, checked in one place: the trainer (trainer/data.py) reads its documents
through `scan`, and the control plane checks an uploaded file with the same call before any job names it, so a
file the check accepted is one the trainer reads.

Streaming: the bytes come as an iterator of chunks and only the current line (and, for the trainer, the documents
it keeps) is held, so a file of any size is checked in little memory. Lines end with "\\n" (a "\\r" before it is
dropped); UTF-8 is checked line by line, which is exact because a newline byte never occurs inside a multi-byte
character.

The formats are the trainer's (contract/spec.py DataSpec.format):
- text: documents separated by blank lines, each stripped of surrounding whitespace;
- jsonl: one JSON object per line with a string field (`text` unless the job names another);
- chat: one JSON object per line with `messages`, a non-empty list of {role, content}, content a string, role one
  of CHAT_ROLES, an assistant's content not empty; as OpenAI's chat format has it, a message may carry a string
  `name` and an assistant message a `weight` of 0 or 1 (0: the trainer learns nothing from it). Tool definitions
  and tool calls (`tools`, `functions`, `tool_calls`, `function_call`) are refused: the trainer renders neither.
- completion: one JSON object per line with string `prompt` and `completion`, the completion not empty (OpenAI's
  format for completion models): the trainer learns the completion given the prompt.
Blank lines are skipped in jsonl, chat and completion.

Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from contract.files import FileFormat

MAX_PROBLEMS = 20
# A line longer than this is refused rather than buffered: no real example is this long, and a file without
# newlines must not be read into memory whole.
MAX_LINE_BYTES = 64 << 20
CHAT_ROLES = ("system", "user", "assistant", "tool")
ASSISTANT = "assistant"
# What OpenAI's chat format may hold and the trainer cannot render: refused by name rather than dropped unseen.
TOOL_KEYS = ("tools", "functions")
TOOL_CALL_KEYS = ("tool_calls", "function_call")
WEIGHTS = (0, 1)
# A str for text and jsonl, a list of {role, content, ...} for chat, {prompt, completion} for completion.
Document = Any


class LineProblem(ValueError):
    """What is wrong with one line, said for its owner (who names the file and the line)."""


@dataclass(frozen=True)
class Problem:
    line: int | None  # 1-based; None for the file as a whole (empty, no documents)
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "message": self.message}


@dataclass
class Scan:
    format: str | None  # as given, or as detected from the first line that is not blank
    lines: int = 0
    examples: int = 0
    # Of the documents' text (text: the stripped document; jsonl: the field; chat: contents; completion: both).
    characters: int = 0
    roles: dict[str, int] = field(default_factory=dict)  # chat: messages per role
    problems: list[Problem] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lines": self.lines, "examples": self.examples, "characters": self.characters}
        if self.format == FileFormat.CHAT.value:
            out["messages"] = dict(sorted(self.roles.items()))
        return out


def split_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes without its end) for each line; None for a line over MAX_LINE_BYTES."""
    buffer = bytearray()
    number = 0
    skipping = False  # inside a line already reported too long: drop bytes until its end
    for chunk in chunks:
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = bytes(buffer[start:end])
            start = end + 1
            number += 1
            if skipping:
                skipping = False
            else:
                yield number, line.removesuffix(b"\r")
        del buffer[:start]
        if len(buffer) > MAX_LINE_BYTES:
            if not skipping:
                yield number + 1, None
                skipping = True
            buffer.clear()
    if buffer and not skipping:
        yield number + 1, bytes(buffer).removesuffix(b"\r")


def decode(raw: bytes | None) -> str:
    if raw is None:
        raise LineProblem(f"is longer than {MAX_LINE_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineProblem(f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_json(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise LineProblem(f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise LineProblem("not valid JSON (nested too deeply)") from None


def jsonl_text(obj: Any, text_field: str = "text") -> str:
    """The document of a jsonl line: its string field."""
    if not isinstance(obj, dict) or text_field not in obj:
        raise LineProblem(f"missing field {text_field!r}")
    if not isinstance(obj[text_field], str):
        raise LineProblem(f"field {text_field!r} is not a string")
    return obj[text_field]


def chat_messages(obj: Any) -> list[dict[str, Any]]:
    """The conversation of a chat line: its checked messages."""
    msgs = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise LineProblem("missing field 'messages' (a non-empty list)")
    for key in TOOL_KEYS:
        if key in obj:
            raise LineProblem(f"field {key!r}: tool definitions are not supported; train on messages without them")
    for i, m in enumerate(msgs):
        if isinstance(m, dict):
            for key in TOOL_CALL_KEYS:
                if key in m:
                    raise LineProblem(f"messages[{i}].{key}: tool calls are not supported; send the answer as "
                                      "'content'")
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise LineProblem(f"each message needs string 'role' and 'content' (messages[{i}] has not)")
        if m["role"] not in CHAT_ROLES:
            raise LineProblem(f"messages[{i}].role {m['role'][:40]!r} is not one of {', '.join(CHAT_ROLES)}")
        if m["role"] == ASSISTANT and not m["content"].strip():
            raise LineProblem(f"messages[{i}] is an assistant message with empty content")
        if "name" in m and not isinstance(m["name"], str):
            raise LineProblem(f"messages[{i}].name is not a string")
        if "weight" in m:
            if m["role"] != ASSISTANT:
                raise LineProblem(f"messages[{i}].weight: only an assistant message has a weight")
            if isinstance(m["weight"], bool) or m["weight"] not in WEIGHTS:
                raise LineProblem(f"messages[{i}].weight is {str(m['weight'])[:40]}; it is 0 or 1")
    return msgs


def learns(message: dict[str, Any]) -> bool:
    """Whether the trainer learns a message's tokens: an assistant's, unless its weight is 0."""
    return bool(message["role"] == ASSISTANT and message.get("weight", 1))


def completion_pair(obj: Any) -> dict[str, str]:
    """The prompt and completion of a completion line."""
    if not isinstance(obj, dict) or "prompt" not in obj or "completion" not in obj:
        raise LineProblem("missing field 'prompt' or 'completion' (each a string)")
    for key in ("prompt", "completion"):
        if not isinstance(obj[key], str):
            raise LineProblem(f"field {key!r} is not a string")
    if not obj["completion"].strip():
        raise LineProblem("field 'completion' is empty: there is nothing to learn")
    return {"prompt": obj["prompt"], "completion": obj["completion"]}


def detect(line: str) -> str:
    """The format of a file from its first line that is not blank: JSON with `messages` is chat, JSON with `prompt`
    and `completion` completion, JSON with `text` jsonl, anything else text."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return FileFormat.TEXT.value
    if isinstance(obj, dict) and "messages" in obj:
        return FileFormat.CHAT.value
    if isinstance(obj, dict) and "prompt" in obj and "completion" in obj:
        return FileFormat.COMPLETION.value
    if isinstance(obj, dict) and "text" in obj:
        return FileFormat.JSONL.value
    return FileFormat.TEXT.value


class _TextDocument:
    """One text document's stripped length, counted as its lines arrive, and its lines where they are kept."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.parts: list[str] = []
        self.started = False
        self.length = 0  # up to the last non-whitespace character
        self.pending = 0  # whitespace after it, counted only if more text follows
        self.first = True

    def add(self, line: str) -> None:
        if self.keep:
            self.parts.append(line)
        piece = line if self.first else "\n" + line
        self.first = False
        if not self.started:
            piece = piece.lstrip()
            if not piece:
                return
            self.started = True
        body = piece.rstrip()
        if body:
            self.length += self.pending + len(body)
            self.pending = len(piece) - len(body)
        else:
            self.pending += len(piece)

    def text(self) -> str:
        return "\n".join(self.parts).strip()


def scan(chunks: Iterable[bytes], fmt: str | None, *, text_field: str = "text",
         on_document: Callable[[Document], None] | None = None, max_problems: int = MAX_PROBLEMS) -> Scan:
    """Check every line of the bytes in `fmt` (None: detected); stops after `max_problems` problems. Each document
    goes to `on_document` where given (the trainer's list); without it, none is kept."""
    result = Scan(format=fmt)
    keep = on_document is not None
    anything = False  # a character that is not whitespace: the file is not empty
    doc: _TextDocument | None = None

    def problem(line: int | None, message: str) -> bool:
        result.problems.append(Problem(line, message))
        return len(result.problems) >= max_problems

    def end_text_document() -> None:
        nonlocal doc
        if doc is not None and doc.started:
            result.examples += 1
            result.characters += doc.length
            if on_document is not None:
                on_document(doc.text())
        doc = None

    for number, raw in split_lines(chunks):
        result.lines = number
        try:
            line = decode(raw)
        except LineProblem as exc:
            if problem(number, str(exc)):
                return result
            continue
        blank = not line.strip()
        anything = anything or not blank
        if result.format is None:
            if blank:
                continue
            result.format = detect(line)
        if result.format == FileFormat.TEXT.value:
            if line == "":
                end_text_document()
            else:
                doc = doc or _TextDocument(keep)
                doc.add(line)
            continue
        if blank:
            continue
        try:
            obj = parse_json(line)
            if result.format == FileFormat.JSONL.value:
                text = jsonl_text(obj, text_field)
                result.characters += len(text)
                document: Document = text
            elif result.format == FileFormat.COMPLETION.value:
                document = completion_pair(obj)
                result.characters += len(document["prompt"]) + len(document["completion"])
            else:
                msgs = chat_messages(obj)
                for m in msgs:
                    result.roles[m["role"]] = result.roles.get(m["role"], 0) + 1
                    result.characters += len(m["content"])
                document = msgs
        except LineProblem as exc:
            if problem(number, str(exc)):
                return result
            continue
        result.examples += 1
        if on_document is not None and not result.problems:
            on_document(document)
    end_text_document()
    if result.problems:
        return result
    if not anything:
        problem(None, "is empty")
    elif result.examples == 0:
        problem(None, "has no documents")
    return result
