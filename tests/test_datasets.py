"""contract/datasets.py, the check an uploaded file passes, agrees with the trainer's reader (trainer/data.py
read_documents) on good and bad files of every format: the same documents, and a refusal for the same line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract import datasets
from contract.spec import DataSpec
from trainer.data import read_documents
from trainer.errors import DataError

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
CASES: list[tuple[str, str, bytes]] = [
    ("text", "paragraphs", b"one\ntwo\n\n\nthree  \n \nfour\r\n\r\nfive"),
    ("text", "crlf only", b"\r\n\r\nword\r\n"),
    ("text", "empty", b" \n\t\n"),
    ("text", "not utf-8", b"ok\n\xc3\x28\n"),
    ("jsonl", "good", b'{"text": "a"}\n\n{"text": "b", "x": 1}\n'),
    ("jsonl", "missing field", b'{"text": "a"}\n{"body": "b"}\n'),
    ("jsonl", "not a string", b'{"text": 3}\n'),
    ("jsonl", "not json", b"plain words\n"),
    ("jsonl", "a list", b'["text"]\n'),
    ("jsonl", "blank only", b"\n\n"),
    ("chat", "good", (json.dumps(CHAT) + "\n").encode() * 2),
    ("chat", "no messages", b'{"messages": []}\n'),
    ("chat", "no content", b'{"messages": [{"role": "user"}]}\n'),
    ("chat", "unknown role", b'{"messages": [{"role": "narrator", "content": "x"}]}\n'),
    ("chat", "empty answer", json.dumps({"messages": [{"role": "user", "content": "q"},
                                                      {"role": "assistant", "content": ""}]}).encode()),
    ("chat", "tool role", json.dumps({"messages": [{"role": "tool", "content": "42"},
                                                   {"role": "assistant", "content": "ok"}]}).encode()),
    # OpenAI's chat format: a `name` on any message, a `weight` of 0 or 1 on an assistant's.
    ("chat", "openai names and weights", json.dumps({"messages": [
        {"role": "system", "content": "Be terse.", "name": "rules"}, {"role": "user", "content": "q", "name": "ann"},
        {"role": "assistant", "content": "skip me", "weight": 0}, {"role": "user", "content": "again"},
        {"role": "assistant", "content": "learn me", "weight": 1}]}).encode()),
    ("chat", "weight 2", json.dumps({"messages": [{"role": "assistant", "content": "a", "weight": 2}]}).encode()),
    ("chat", "weight true", json.dumps({"messages": [{"role": "assistant", "content": "a", "weight": True}]}).encode()),
    ("chat", "weight on a user", json.dumps({"messages": [{"role": "user", "content": "a", "weight": 1}]}).encode()),
    ("chat", "name not a string", json.dumps({"messages": [{"role": "user", "content": "a", "name": 3}]}).encode()),
    ("chat", "tool calls", json.dumps({"messages": [{"role": "user", "content": "weather?"}, {
        "role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                             "function": {"name": "w", "arguments": "{}"}}]}]}).encode()),
    ("chat", "tools", json.dumps({"tools": [], "messages": [{"role": "assistant", "content": "a"}]}).encode()),
    ("completion", "good", b'{"prompt": "2+2=", "completion": " 4"}\n\n{"prompt": "", "completion": "x", "id": 1}\n'),
    ("completion", "empty completion", b'{"prompt": "2+2=", "completion": " "}\n'),
    ("completion", "missing completion", b'{"prompt": "2+2="}\n'),
    ("completion", "not a string", b'{"prompt": 2, "completion": "4"}\n'),
]


@pytest.mark.parametrize(("fmt", "name", "content"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_check_and_the_trainer_agree(tmp_path: Path, fmt: str, name: str, content: bytes) -> None:
    path = tmp_path / "data"
    path.write_bytes(content)
    docs: list[object] = []
    # In chunks of 3 bytes: lines and characters cut across chunk boundaries read the same.
    found = datasets.scan([content[i:i + 3] for i in range(0, len(content), 3)], fmt, on_document=docs.append)
    try:
        trained = read_documents(path, DataSpec(train=str(path), format=fmt))
    except DataError as exc:
        assert found.problems, f"the trainer refused what the check accepted: {exc}"
        first = found.problems[0]
        assert (f"line {first.line}: " if first.line else "") + first.message in str(exc)
        return
    assert not found.problems, found.problems
    assert docs == trained and found.examples == len(trained)


def test_text_documents_are_those_the_trainer_read_before_the_refactor(tmp_path: Path) -> None:
    """The old reader split the whole text on blank lines; the line by line one gives the same documents."""
    text = "a\n\n\nb\n \nc\r\n\r\nd  \n\n  e\n"
    expected = [d.strip() for d in text.replace("\r\n", "\n").split("\n\n") if d.strip()]
    path = tmp_path / "t.txt"
    path.write_text(text)
    assert read_documents(path, DataSpec(train=str(path), format="text")) == expected


@pytest.mark.parametrize(("line", "message"), [
    ({"messages": [{"role": "assistant", "content": "a", "weight": 2}]}, "messages[0].weight is 2; it is 0 or 1"),
    ({"messages": [{"role": "user", "content": "a", "weight": 0}]}, "only an assistant message has a weight"),
    ({"messages": [{"role": "user", "content": "a", "name": None}]}, "messages[0].name is not a string"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {}}]}, "messages[0].function_call: tool"),
    ({"functions": [], "messages": [{"role": "user", "content": "a"}]}, "field 'functions': tool definitions"),
])
def test_what_openais_chat_format_allows_and_the_trainer_cannot_is_refused_by_name(line: dict[str, object],
                                                                                    message: str) -> None:
    found = datasets.scan([json.dumps(line).encode()], None)
    assert found.format == "chat" and [p.line for p in found.problems] == [1], found
    assert message in found.problems[0].message


@pytest.mark.parametrize(("first", "fmt"), [
    ({"prompt": "a", "completion": "b"}, "completion"), ({"messages": [], "prompt": "a", "completion": "b"}, "chat"),
    ({"prompt": "a", "text": "b"}, "jsonl"), ({"completion": "b"}, "text")])
def test_openais_prompt_completion_lines_are_detected(first: dict[str, object], fmt: str) -> None:
    assert datasets.scan([json.dumps(first).encode()], None).format == fmt


def test_completion_stats_count_both_sides() -> None:
    found = datasets.scan([b'{"prompt": "abc", "completion": "de"}\n{"prompt": "", "completion": "f"}\n'], None)
    assert not found.problems and found.stats() == {"lines": 2, "examples": 2, "characters": 6}
