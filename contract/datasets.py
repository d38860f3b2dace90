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
- preference: one pair per line, a prompt and two answers to it, one preferred (for DPO), in either of two shapes:
  OpenAI's DPO shape {"input": {"messages": [...]}, "preferred_output": [one assistant message],
  "non_preferred_output": [one assistant message]}, or trl's {"prompt", "chosen", "rejected"}, all three strings
  or, conversational, `prompt` a list of messages and each answer a list of one assistant message. Both become one
  `PreferencePair`. trl's implicit-prompt form (whole conversations in `chosen` and `rejected`) is refused, naming
  the explicit form to send: which turns are the prompt is then the sender's decision, not a guess from a shared
  prefix.
Blank lines are skipped in jsonl, chat, completion and preference. A line of one method's shape given as the
other's (a preference pair declared chat, a chat example declared preference) is refused naming what it is.

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
# A str for text and jsonl, a list of {role, content, ...} for chat, {prompt, completion} for completion, a
# PreferencePair for preference.
Document = Any

OPENAI_PAIR_KEYS = ("input", "preferred_output", "non_preferred_output")
TRL_PAIR_KEYS = ("prompt", "chosen", "rejected")
# OpenAI's DPO `input` may name tools and allow parallel calls: refused by name, as a chat line's tools are.
PROMPT_TOOL_KEYS = (*TOOL_KEYS, "parallel_tool_calls")
SHAPES = {"openai": "OpenAI's DPO shape", "trl": "trl's prompt/chosen/rejected shape"}
SIDES = ("prompt", "chosen", "rejected")
# What each method's data must be: the line-level refusal (`scan`) and the job-level one (`format_conflict`) end
# with the same words, so an upload and a job submit say the same.
NEEDS_SUPERVISED = "a supervised job needs chat, completion, jsonl or text"
NEEDS_PREFERENCE = ("a preference file needs OpenAI's DPO shape (input.messages, preferred_output, "
                    "non_preferred_output) or trl's (prompt, chosen, rejected)")


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
    # Of the documents' text (text: the stripped document; jsonl: the field; chat: contents; completion: both;
    # preference: the prompt's contents and both answers).
    characters: int = 0
    roles: dict[str, int] = field(default_factory=dict)  # chat: messages per role
    sides: dict[str, int] = field(default_factory=dict)  # preference: characters of the prompts, chosen, rejected
    problems: list[Problem] = field(default_factory=list)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lines": self.lines, "examples": self.examples, "characters": self.characters}
        if self.format == FileFormat.CHAT.value:
            out["messages"] = dict(sorted(self.roles.items()))
        if self.format == FileFormat.PREFERENCE.value:
            out["characters_per_side"] = {side: self.sides.get(side, 0) for side in SIDES}
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
    return _check_messages(msgs, "messages")


def _check_messages(msgs: list[Any], where: str) -> list[dict[str, Any]]:
    """Messages checked by the chat rules; `where` names the list in the problem (a chat line's `messages`, a
    pair's prompt)."""
    for i, m in enumerate(msgs):
        if isinstance(m, dict):
            for key in TOOL_CALL_KEYS:
                if key in m:
                    raise LineProblem(f"{where}[{i}].{key}: tool calls are not supported; send the answer as "
                                      "'content'")
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise LineProblem(f"each message needs string 'role' and 'content' ({where}[{i}] has not)")
        if m["role"] not in CHAT_ROLES:
            raise LineProblem(f"{where}[{i}].role {m['role'][:40]!r} is not one of {', '.join(CHAT_ROLES)}")
        if m["role"] == ASSISTANT and not m["content"].strip():
            raise LineProblem(f"{where}[{i}] is an assistant message with empty content")
        if "name" in m and not isinstance(m["name"], str):
            raise LineProblem(f"{where}[{i}].name is not a string")
        if "weight" in m:
            if m["role"] != ASSISTANT:
                raise LineProblem(f"{where}[{i}].weight: only an assistant message has a weight")
            if isinstance(m["weight"], bool) or m["weight"] not in WEIGHTS:
                raise LineProblem(f"{where}[{i}].weight is {str(m['weight'])[:40]}; it is 0 or 1")
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


@dataclass(frozen=True)
class PreferencePair:
    """One preference line, whatever its shape: the prompt (a string, or messages each {role, content} and `name`
    where given) and the two answers' texts. Both answers are the assistant's when the prompt is messages."""

    prompt: str | list[dict[str, str]]
    chosen: str
    rejected: str

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)

    def prompt_characters(self) -> int:
        if isinstance(self.prompt, str):
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.prompt)


# The length rule of a pair, the trainer's (trainer/pairs.py) and the dry run's survey of a dpo job's pairs
# (api/services/lengths.py): the prompt is kept whole, both answers are cut to the room it leaves, and a pair is
# dropped when the room cannot hold an answer's first token and the one it is learned from, or the cut answers are
# the same (nothing left to prefer).
MIN_ANSWER_TOKENS = 2
PROMPT_TOO_LONG = "prompt_too_long"
SAME_AFTER_TRUNCATION = "same_after_truncation"


@dataclass(frozen=True)
class PairCut:
    chosen: list[int]
    rejected: list[int]
    truncated: bool  # at least one answer was cut at its end
    dropped: str | None  # PROMPT_TOO_LONG or SAME_AFTER_TRUNCATION; None: the pair is kept


def cut_pair(prompt_tokens: int, chosen: list[int], rejected: list[int], seq_len: int) -> PairCut:
    room = seq_len - prompt_tokens
    if room < MIN_ANSWER_TOKENS:
        return PairCut(chosen, rejected, False, PROMPT_TOO_LONG)
    truncated = len(chosen) > room or len(rejected) > room
    chosen, rejected = chosen[:room], rejected[:room]
    return PairCut(chosen, rejected, truncated, SAME_AFTER_TRUNCATION if chosen == rejected else None)


def preference_shape(obj: Any) -> str | None:
    """"openai" or "trl" for a JSON value that carries a pair's answers in that shape's fields, else None."""
    if not isinstance(obj, dict):
        return None
    if "preferred_output" in obj or "non_preferred_output" in obj:
        return "openai"
    if "chosen" in obj or "rejected" in obj:
        return "trl"
    return None


def _what_else(obj: dict[str, Any]) -> str:
    """What a line that is no preference pair looks like, in the words of its own format."""
    if "messages" in obj:
        return "a chat example"
    if "prompt" in obj and "completion" in obj:
        return "a completion example (prompt and completion)"
    if "text" in obj:
        return "a jsonl example (text)"
    return "not a preference pair"


def _pair_prompt(msgs: list[Any], where: str) -> list[dict[str, str]]:
    if not msgs:
        raise LineProblem(f"field {where!r} is empty; a pair needs a prompt")
    _check_messages(msgs, where)
    for i, m in enumerate(msgs):
        if "weight" in m:
            raise LineProblem(f"{where}[{i}].weight: nothing in the prompt is learned; a pair learns from its "
                              "two answers only")
    if not any(m["content"].strip() for m in msgs):
        raise LineProblem(f"field {where!r} has no text; a pair needs a prompt")
    return [{k: m[k] for k in ("role", "content", "name") if k in m} for m in msgs]


def _answer_message(obj: dict[str, Any], key: str) -> str:
    """The text of a side given as a list of one assistant message (OpenAI's outputs, trl's conversational)."""
    if key not in obj:
        raise LineProblem(f"missing field {key!r} (a list of one assistant message)")
    value = obj[key]
    if isinstance(value, str):
        raise LineProblem(f"field {key!r} is a string but the prompt is a list of messages; send all three as "
                          "strings or all as messages")
    if not isinstance(value, list):
        raise LineProblem(f"field {key!r} is not a list (of one assistant message)")
    if len(value) != 1:
        raise LineProblem(f"field {key!r} holds {len(value)} messages; it holds one assistant message")
    m = value[0]
    where = f"{key}[0]"
    if not isinstance(m, dict):
        raise LineProblem(f"{where} is not a message object")
    for k in TOOL_CALL_KEYS:
        if k in m:
            raise LineProblem(f"{where}.{k}: tool calls are not supported; send the answer as 'content'")
    if m.get("role") != ASSISTANT:
        raise LineProblem(f"{where}.role is {str(m.get('role'))[:40]!r}; a pair's answers are the assistant's")
    if not isinstance(m.get("content"), str):
        raise LineProblem(f"{where}.content is not a string")
    if not m["content"].strip():
        raise LineProblem(f"{where}.content is empty; each side needs an answer")
    return str(m["content"])


def _answer_text(obj: dict[str, Any], key: str) -> str:
    """The text of a side given as a string (trl's standard shape)."""
    if key not in obj:
        raise LineProblem(f"missing field {key!r} (a string, the answer)")
    if isinstance(obj[key], list):
        raise LineProblem(f"field {key!r} is a list of messages but 'prompt' is a string; send all three as "
                          "strings or all as messages")
    if not isinstance(obj[key], str):
        raise LineProblem(f"field {key!r} is not a string")
    if not obj[key].strip():
        raise LineProblem(f"field {key!r} is empty; each side needs an answer")
    return str(obj[key])


def _refuse_tools(obj: dict[str, Any], prefix: str) -> None:
    for key in PROMPT_TOOL_KEYS:
        if key in obj:
            what = "tool calls" if key == "parallel_tool_calls" else "tool definitions"
            raise LineProblem(f"field '{prefix}{key}': {what} are not supported; train on messages without them")


def preference_pair(obj: Any) -> PreferencePair:
    """The pair of a preference line, in OpenAI's DPO shape or trl's, as one PreferencePair."""
    if not isinstance(obj, dict):
        raise LineProblem(f"is not a JSON object; {NEEDS_PREFERENCE}")
    shape = preference_shape(obj)
    if shape is None:
        if "input" in obj:
            shape = "openai"
        elif "prompt" in obj and "completion" not in obj:
            shape = "trl"
        else:
            raise LineProblem(f"this line is {_what_else(obj)}; {NEEDS_PREFERENCE}")
    own, other = (OPENAI_PAIR_KEYS, TRL_PAIR_KEYS) if shape == "openai" else (TRL_PAIR_KEYS, OPENAI_PAIR_KEYS)
    if mixed := [k for k in other if k in obj]:
        ours = [k for k in own if k in obj]
        raise LineProblem(f"mixes {SHAPES[shape]} ({', '.join(ours)}) with fields of the other shape "
                          f"({', '.join(mixed)}); send one shape")
    # Fields of the supervised formats beside a pair's: which one holds the prompt or an answer would be a guess.
    for key, example in (("messages", "a chat example"), ("completion", "a completion example")):
        if key in obj:
            raise LineProblem(f"field {key!r} belongs to {example}, not to a pair; {NEEDS_PREFERENCE}")
    _refuse_tools(obj, "")
    if shape == "openai":
        names = ("preferred_output", "non_preferred_output")
        given = obj.get("input")
        if not isinstance(given, dict):
            raise LineProblem("missing field 'input' (an object whose 'messages' are the prompt)")
        _refuse_tools(given, "input.")
        if not isinstance(given.get("messages"), list):
            raise LineProblem("missing field 'input.messages' (a list of messages, the prompt)")
        prompt: str | list[dict[str, str]] = _pair_prompt(given["messages"], "input.messages")
        chosen, rejected = (_answer_message(obj, k) for k in names)
    else:
        names = ("chosen", "rejected")
        if "prompt" not in obj:
            if any(isinstance(obj.get(k), list) for k in names):
                raise LineProblem("missing field 'prompt': trl's implicit-prompt form (whole conversations in "
                                  "'chosen' and 'rejected') is not accepted; send the shared turns as 'prompt' and "
                                  "one assistant message in each of 'chosen' and 'rejected'")
            raise LineProblem("missing field 'prompt' (the text both answers follow)")
        if isinstance(obj["prompt"], str):
            if not obj["prompt"].strip():
                raise LineProblem("field 'prompt' is empty; a pair needs a prompt")
            prompt = obj["prompt"]
            chosen, rejected = (_answer_text(obj, k) for k in names)
        elif isinstance(obj["prompt"], list):
            prompt = _pair_prompt(obj["prompt"], "prompt")
            chosen, rejected = (_answer_message(obj, k) for k in names)
        else:
            raise LineProblem("field 'prompt' is not a string or a list of messages")
    # Equal answers give equal log-ratios: the pair would add no gradient, only count as data.
    if chosen.strip() == rejected.strip():
        raise LineProblem(f"fields {names[0]!r} and {names[1]!r} hold the same answer; a pair teaches only by "
                          "their difference")
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected)


def format_conflict(declared: str, found: str, where: str) -> str | None:
    """For a job whose data.format is `declared` naming a file checked as `found` (`where`: the job's field):
    why the two cannot go together when one is the preference format and the other a supervised one, ending as a
    line of such a file is refused by `scan`; None when both are of one method."""
    preference = FileFormat.PREFERENCE.value
    if (declared == preference) == (found == preference):
        return None
    needs = NEEDS_SUPERVISED if found == preference else NEEDS_PREFERENCE
    return f"is {declared!r} but {where} is a {found} file; {needs}"


def detect(line: str) -> str:
    """The format of a file from its first line that is not blank: JSON with `messages` is chat, JSON with `prompt`
    and `completion` completion, JSON with a pair's answers (`preferred_output`/`non_preferred_output`, or
    `chosen`/`rejected`) preference, JSON with `text` jsonl, anything else text."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return FileFormat.TEXT.value
    if isinstance(obj, dict) and "messages" in obj:
        return FileFormat.CHAT.value
    if isinstance(obj, dict) and "prompt" in obj and "completion" in obj:
        return FileFormat.COMPLETION.value
    if preference_shape(obj) is not None:
        return FileFormat.PREFERENCE.value
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


def _supervised(obj: Any, result: Scan, text_field: str) -> Document:
    """The document of a jsonl, completion or chat line, counted into `result`. A line this refuses that is a
    preference pair is refused as one: its own problem (a missing `messages`) would not say what is wrong."""
    try:
        if result.format == FileFormat.JSONL.value:
            text = jsonl_text(obj, text_field)
            result.characters += len(text)
            return text
        if result.format == FileFormat.COMPLETION.value:
            pair = completion_pair(obj)
            result.characters += len(pair["prompt"]) + len(pair["completion"])
            return pair
        msgs = chat_messages(obj)
    except LineProblem:
        # Only where the format's own field is missing: a chat line with a bad message stays a chat line's problem.
        own = (text_field if result.format == FileFormat.JSONL.value
               else "completion" if result.format == FileFormat.COMPLETION.value else "messages")
        if (shape := preference_shape(obj)) is not None and own not in obj:
            raise LineProblem(f"this line is a preference pair ({SHAPES[shape]}); {NEEDS_SUPERVISED}") from None
        raise
    for m in msgs:
        result.roles[m["role"]] = result.roles.get(m["role"], 0) + 1
        result.characters += len(m["content"])
    return msgs


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
            if result.format == FileFormat.PREFERENCE.value:
                pair = preference_pair(obj)
                sizes = (pair.prompt_characters(), len(pair.chosen), len(pair.rejected))
                for side, size in zip(SIDES, sizes, strict=True):
                    result.sides[side] = result.sides.get(side, 0) + size
                result.characters += sum(sizes)
                document: Document = pair
            else:
                document = _supervised(obj, result, text_field)
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
