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
