"""Preference pairs: contract/datasets.py checks and normalises both shapes (OpenAI's DPO, trl's) line by line, and
trainer/pairs.py tokenizes them and packs both sides of a pair into one row. The tokenizer is trained here on a few
sentences (trainer/tiny.py), nothing is downloaded."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from contract import datasets
from contract.datasets import NEEDS_PREFERENCE, NEEDS_SUPERVISED, PROMPT_TOO_LONG, SAME_AFTER_TRUNCATION, PreferencePair
from trainer.data import IGNORE, encode_chat
from trainer.dpo import scored_tokens
from trainer.pairs import (
    CHOSEN,
    REJECTED,
    EncodedPair,
    PairStats,
    encode_pair,
    encode_pairs,
    pack_pairs,
)
from trainer.tiny import EOS, build_tokenizer

USER = {"role": "user", "content": "What is two plus two?"}
SYSTEM = {"role": "system", "content": "Be brief."}


def answer(text: str, role: str = "assistant") -> list[dict[str, str]]:
    return [{"role": role, "content": text}]


OPENAI = {"input": {"messages": [SYSTEM, USER]}, "preferred_output": answer("Four."),
          "non_preferred_output": answer("Five.")}
TRL_CONVERSATIONAL = {"prompt": [SYSTEM, USER], "chosen": answer("Four."), "rejected": answer("Five.")}
TRL_STANDARD = {"prompt": "Two plus two is", "chosen": " four.", "rejected": " five."}


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for key, value in changes.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


def scan_lines(*lines: Any, fmt: str | None = "preference") -> datasets.Scan:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return datasets.scan([text.encode()], fmt)


BAD: list[tuple[str, Any, str]] = [
    ("openai missing side", with_(OPENAI, non_preferred_output=None),
     "missing field 'non_preferred_output' (a list of one assistant message)"),
    ("trl missing side", with_(TRL_STANDARD, rejected=None), "missing field 'rejected'"),
    ("openai empty side", with_(OPENAI, preferred_output=answer("  ")),
     "preferred_output[0].content is empty; each side needs an answer"),
    ("trl empty side", with_(TRL_STANDARD, chosen=""), "field 'chosen' is empty; each side needs an answer"),
    ("trl conversational empty side", with_(TRL_CONVERSATIONAL, rejected=answer("")), "rejected[0].content is empty"),
    ("two answers", with_(OPENAI, preferred_output=answer("Four.") + answer("Really four.")),
     "field 'preferred_output' holds 2 messages; it holds one assistant message"),
    ("no answer", with_(TRL_CONVERSATIONAL, chosen=[]), "field 'chosen' holds 0 messages"),
    ("not the assistant's", with_(OPENAI, non_preferred_output=answer("Five.", role="user")),
     "non_preferred_output[0].role is 'user'; a pair's answers are the assistant's"),
    ("identical", with_(OPENAI, non_preferred_output=answer("Four.")),
     "fields 'preferred_output' and 'non_preferred_output' hold the same answer"),
    ("identical but for spaces", with_(TRL_STANDARD, rejected=" four. "),
     "fields 'chosen' and 'rejected' hold the same answer"),
    ("openai empty prompt", with_(OPENAI, input={"messages": []}), "field 'input.messages' is empty; a pair needs a"),
    ("trl empty prompt", with_(TRL_STANDARD, prompt=" "), "field 'prompt' is empty; a pair needs a prompt"),
    ("blank prompt messages", with_(TRL_CONVERSATIONAL, prompt=[{"role": "user", "content": " "}]),
     "field 'prompt' has no text"),
    ("no input", with_(OPENAI, input=None), "missing field 'input'"),
    ("tools in the input", with_(OPENAI, input={"messages": [USER], "tools": []}),
     "field 'input.tools': tool definitions are not supported"),
    ("parallel tool calls", with_(OPENAI, input={"messages": [USER], "parallel_tool_calls": True}),
     "field 'input.parallel_tool_calls': tool calls are not supported"),
    ("tools beside trl's", with_(TRL_CONVERSATIONAL, tools=[]), "field 'tools': tool definitions are not supported"),
    ("a tool call as the answer", with_(OPENAI, preferred_output=[{"role": "assistant", "tool_calls": []}]),
     "preferred_output[0].tool_calls: tool calls are not supported"),
    ("a tool call in the prompt", with_(OPENAI, input={"messages": [USER, {"role": "assistant", "content": "x",
                                                                           "function_call": {}}]}),
     "input.messages[1].function_call: tool calls are not supported"),
    ("content parts as the answer", with_(OPENAI, preferred_output=[{"role": "assistant",
                                                                    "content": [{"type": "text", "text": "4"}]}]),
     "preferred_output[0].content is not a string"),
    ("content parts in the prompt", with_(TRL_CONVERSATIONAL, prompt=[{"role": "user", "content": None}]),
     "each message needs string 'role' and 'content' (prompt[0] has not)"),
    ("a number as the answer", with_(TRL_STANDARD, chosen=4), "field 'chosen' is not a string"),
    ("a weight in the prompt", with_(TRL_CONVERSATIONAL, prompt=[USER, {"role": "assistant", "content": "a",
                                                                        "weight": 1}, USER]),
     "prompt[1].weight: nothing in the prompt is learned"),
    ("a chat line", {"messages": [USER, answer("Four.")[0]]},
     f"this line is a chat example; {NEEDS_PREFERENCE}"),
    ("a completion line", {"prompt": "2+2=", "completion": "4"},
     f"this line is a completion example (prompt and completion); {NEEDS_PREFERENCE}"),
    ("a jsonl line", {"text": "four"}, f"this line is a jsonl example (text); {NEEDS_PREFERENCE}"),
    ("messages beside a pair", with_(TRL_STANDARD, messages=[USER]), "field 'messages' belongs to a chat example"),
    ("both shapes", with_(OPENAI, chosen="Four."),
     "mixes OpenAI's DPO shape (input, preferred_output, non_preferred_output) with fields of the other shape "
     "(chosen); send one shape"),
    ("implicit prompt", {"chosen": [USER, *answer("Four.")], "rejected": [USER, *answer("Five.")]},
     "missing field 'prompt': trl's implicit-prompt form (whole conversations in 'chosen' and 'rejected') is not "
     "accepted; send the shared turns as 'prompt' and one assistant message in each of 'chosen' and 'rejected'"),
    ("no prompt", with_(TRL_STANDARD, prompt=None), "missing field 'prompt' (the text both answers follow)"),
    ("string prompt, message answers", with_(TRL_STANDARD, chosen=answer("four")),
     "field 'chosen' is a list of messages but 'prompt' is a string; send all three as strings or all as messages"),
    ("message prompt, string answers", with_(TRL_CONVERSATIONAL, rejected="Five."),
     "field 'rejected' is a string but the prompt is a list of messages"),
    ("a number as the prompt", with_(TRL_STANDARD, prompt=2), "field 'prompt' is not a string or a list of messages"),
    ("a list", [TRL_STANDARD], f"is not a JSON object; {NEEDS_PREFERENCE}"),
    ("not json", "{prompt: 1}", "not valid JSON"),
]


@pytest.mark.parametrize(("line", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_malformed_pair_is_refused_with_its_line_and_field(line: Any, message: str) -> None:
    # A good line, a blank one, then the bad one: line 3, whichever shape the first one is.
    found = scan_lines(OPENAI, "", line, TRL_STANDARD)
    assert [p.line for p in found.problems] == [3], found.problems
    assert message in found.problems[0].message, found.problems[0].message


def test_both_shapes_give_the_same_pair() -> None:
    pairs: list[PreferencePair] = []
    found = datasets.scan([(json.dumps(OPENAI) + "\n" + json.dumps(TRL_CONVERSATIONAL) + "\n").encode()],
                          "preference", on_document=pairs.append)
    assert not found.problems and pairs[0] == pairs[1]
    assert pairs[0] == PreferencePair(prompt=[SYSTEM, USER], chosen="Four.", rejected="Five.")
    assert pairs[0].conversational
    standard = datasets.preference_pair(TRL_STANDARD)
    assert standard == PreferencePair(prompt="Two plus two is", chosen=" four.", rejected=" five.")
    assert not standard.conversational
    # A message's name is kept for the template; extra fields of the line (trl's columns, an id) are not the pair's.
    named = datasets.preference_pair(with_(OPENAI, id=7, input={"messages": [{**USER, "name": "ann"}]}))
    assert named.prompt == [{**USER, "name": "ann"}]


@pytest.mark.parametrize(("first", "fmt"), [
    (OPENAI, "preference"), (TRL_STANDARD, "preference"), (TRL_CONVERSATIONAL, "preference"),
    ({"chosen": "a", "rejected": "b"}, "preference"), ({"preferred_output": []}, "preference"),
    # The supervised formats are detected as before, their own fields first.
    ({"messages": [], "chosen": "a"}, "chat"), ({"prompt": "a", "completion": "b", "chosen": "c"}, "completion"),
    ({"input": {"messages": []}}, "text"), ({"prompt": "a", "text": "b"}, "jsonl")])
def test_the_shape_of_the_first_line_is_detected(first: dict[str, Any], fmt: str) -> None:
    assert datasets.scan([json.dumps(first).encode()], None).format == fmt


def test_stats_count_pairs_and_characters_per_side() -> None:
    found = scan_lines(OPENAI, "", TRL_STANDARD, fmt=None)
    prompt = len("Be brief.") + len(USER["content"]) + len("Two plus two is")
    chosen, rejected = len("Four.") + len(" four."), len("Five.") + len(" five.")
    assert not found.problems and found.format == "preference"
    assert found.stats() == {"lines": 3, "examples": 2, "characters": prompt + chosen + rejected,
                             "characters_per_side": {"prompt": prompt, "chosen": chosen, "rejected": rejected}}


@pytest.mark.parametrize("content", [b"", b"\n\n  \n\r\n"])
def test_a_file_without_pairs_is_refused(content: bytes) -> None:
    found = datasets.scan([content], "preference")
    assert found.examples == 0 and [(p.line, p.message) for p in found.problems] == [(None, "is empty")]


@pytest.mark.parametrize(("fmt", "line", "shape"), [
    ("chat", OPENAI, "OpenAI's DPO shape"), ("chat", TRL_CONVERSATIONAL, "trl's prompt/chosen/rejected shape"),
    ("completion", TRL_STANDARD, "trl's prompt/chosen/rejected shape"), ("jsonl", OPENAI, "OpenAI's DPO shape")])
def test_a_preference_file_given_as_a_supervised_format_is_refused_naming_its_shape(fmt: str, line: Any,
                                                                                     shape: str) -> None:
    found = scan_lines(line, fmt=fmt)
    assert [(p.line, p.message) for p in found.problems] == [
        (1, f"this line is a preference pair ({shape}); a supervised job needs chat, completion, jsonl or text")]


def test_a_job_on_a_file_of_the_other_method_is_refused_in_the_same_words() -> None:
    assert datasets.format_conflict("chat", "preference", "data.train") == (
        f"is 'chat' but data.train is a preference file; {NEEDS_SUPERVISED}")
    assert datasets.format_conflict("preference", "chat", "data.validation") == (
        f"is 'preference' but data.validation is a chat file; {NEEDS_PREFERENCE}")
    assert datasets.format_conflict("chat", "completion", "data.train") is None
    assert datasets.format_conflict("preference", "preference", "data.train") is None
    assert NEEDS_PREFERENCE in scan_lines({"messages": [USER]}).problems[0].message
    assert NEEDS_SUPERVISED in scan_lines(OPENAI, fmt="chat").problems[0].message


# -- trainer/pairs.py --

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    corpus = ("Be brief. What is two plus two? Four. Five. Two plus two is four, not five. The quick brown fox "
              "jumps over the lazy dog. [user] [assistant] [system]\n") * 40
    return build_tokenizer(corpus, vocab_size=320, max_pos=512)


def learned(tok: PreTrainedTokenizerFast, ids: list[int], labels: list[int]) -> str:
    return tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE])


@pytest.mark.parametrize("with_template", [False, True])
def test_a_conversational_pair_is_rendered_as_encode_chat_renders_and_learns_only_its_answers(
        tokenizer: PreTrainedTokenizerFast, with_template: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tokenizer
    monkeypatch.setattr(tok, "chat_template", TEMPLATE if with_template else None)
    pair = datasets.preference_pair(OPENAI)
    encoded = encode_pair(tok, pair, 256)
    assert encoded is not None and not encoded.truncated
    for side, text in ((CHOSEN, "Four."), (REJECTED, "Five.")):
        ids, labels = encoded.side(side)
        # The same tokens an SFT job on this conversation trains on: one template for both methods.
        sft_ids, _ = encode_chat(tok, [*pair.prompt, {"role": "assistant", "content": text}])
        assert ids == sft_ids and ids[-1] == tok.eos_token_id
        header = "[assistant] " if with_template else "<|assistant|>\n"
        assert learned(tok, ids, labels) == f"{header}{text}\n{EOS}"
        assert labels[: len(encoded.prompt)] == [IGNORE] * len(encoded.prompt)
    assert encoded.prompt == encode_chat(tok, pair.prompt)[0][:-1]


def test_a_string_pair_learns_each_answer_given_the_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    encoded = encode_pair(tokenizer, datasets.preference_pair(TRL_STANDARD), 64)
    assert encoded is not None
    assert tokenizer.decode(encoded.prompt) == "Two plus two is"
    assert learned(tokenizer, *encoded.side(CHOSEN)) == f" four.{EOS}"
    assert learned(tokenizer, *encoded.side(REJECTED)) == f" five.{EOS}"


def test_long_answers_are_cut_and_long_prompts_dropped(tokenizer: PreTrainedTokenizerFast) -> None:
    tok = tokenizer
    prompt = "Two plus two is"
    p = len(tok(prompt, add_special_tokens=False)["input_ids"])
    long_a, long_b = " four" * 30, " four" * 29 + " five"
    pairs = [
        PreferencePair(prompt=prompt, chosen=" four.", rejected=" five."),  # fits
        PreferencePair(prompt=prompt, chosen=long_a, rejected=" five."),  # chosen cut
        PreferencePair(prompt=prompt, chosen=long_a, rejected=long_b),  # equal once cut
        PreferencePair(prompt=" ".join(["two"] * 40), chosen=" four.", rejected=" five."),  # no room
    ]
    seq_len = p + 8
    kept, stats = encode_pairs(tok, pairs, seq_len)
    assert len(kept[1].prompt) + len(kept[1].chosen) == seq_len
    assert kept[1].truncated and not kept[0].truncated and kept[1].chosen[-1] != tok.eos_token_id
    assert stats.as_dict() == {
        "pairs_kept": 2, "pairs_truncated": 1, "pairs_dropped": 2,
        "dropped": {PROMPT_TOO_LONG: 1, SAME_AFTER_TRUNCATION: 1},
        "tokens": {"prompt": 2 * p, "chosen": sum(len(e.chosen) for e in kept),
                   "rejected": sum(len(e.rejected) for e in kept)}}
    # The edge of the rule: a prompt of seq_len - 2 tokens keeps two of each answer, one of seq_len - 1 none.
    assert encode_pair(tok, pairs[0], p + 2) is not None
    stats = PairStats()
    assert encode_pair(tok, pairs[0], p + 1, stats) is None and stats.dropped == {PROMPT_TOO_LONG: 1}


def fake(prompt: int, chosen: int, rejected: int, base: int) -> EncodedPair:
    """A pair of distinct made-up ids (base, base+1, ...), so each token says where it came from."""
    ids = list(range(base, base + prompt + chosen + rejected))
    return EncodedPair(prompt=ids[:prompt], chosen=ids[prompt:prompt + chosen], rejected=ids[prompt + chosen:],
                       truncated=False)


def test_packing_keeps_both_sides_of_a_pair_in_one_row(tokenizer: PreTrainedTokenizerFast) -> None:
    seq_len = 10
    pairs = [fake(3, 2, 4, 100), fake(2, 2, 2, 200), fake(6, 4, 3, 300), fake(1, 9, 9, 400)]
    blocks = pack_pairs(pairs, seq_len, pad_id=0, packing=True)
    # Rows of 2 * seq_len, filled next fit in order: pairs 0 and 1 (12 + 8 tokens), pair 2 (19, padded by one),
    # pair 3 (20: two sides of seq_len each).
    assert blocks.input_ids.shape == (3, 20) and blocks.attention_mask is None and len(blocks) == 3
    assert blocks.seq_pair.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert blocks.seq_row.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert blocks.seq_side.tolist() == [CHOSEN, REJECTED] * 4
    assert blocks.row_start.tolist() == [0, 4, 6, 8]
    row0 = [t for p in pairs[:2] for side in (CHOSEN, REJECTED) for t in p.side(side)[0]]
    assert blocks.input_ids[0].tolist() == row0
    assert blocks.segment_ids[0].tolist() == [0] * 5 + [1] * 7 + [2] * 4 + [3] * 4
    assert blocks.segment_ids[1].tolist() == [0] * 10 + [1] * 9 + [-1]
    assert blocks.position_ids[0].tolist() == [*range(5), *range(7), *range(4), *range(4)]
    assert blocks.position_ids[1].tolist() == [*range(10), *range(9), 0]
    assert (blocks.position_ids < seq_len).all()
    # Labels: the answers only, never a prompt or padding.
    assert blocks.labels[0].tolist() == [IGNORE] * 3 + [103, 104] + [IGNORE] * 3 + [105, 106, 107, 108] + \
        [IGNORE] * 2 + [202, 203] + [IGNORE] * 2 + [204, 205]
    assert blocks.labels[1, -1] == IGNORE
    assert blocks.real_tokens.tolist() == [20, 19, 20] and blocks.packing_efficiency == pytest.approx(59 / 60)
    again = pack_pairs(pairs, seq_len, pad_id=0, packing=True)
    assert all(torch.equal(getattr(blocks, f), getattr(again, f))
               for f in ("input_ids", "labels", "position_ids", "segment_ids", "seq_pair", "seq_side"))

    batch = blocks.batch([1, 0])
    # Sequences ordered chosen first, pairs in the order met: pair 2 (row 1), then pairs 0 and 1 (row 0).
    assert batch["pair_ids"].tolist() == [2, 0, 1, 2, 0, 1]
    assert batch["chosen"].tolist() == [True, True, True, False, False, False]
    assert batch["sequence_ids"][0].tolist() == [0] * 10 + [3] * 9 + [-1]
    assert batch["sequence_ids"][1].tolist() == [1] * 5 + [4] * 7 + [2] * 4 + [5] * 4
    # A per-sequence sum over learned tokens, as a DPO loss gathers its log-probs, counts each answer's tokens.
    mask = batch["labels"] != IGNORE
    counts = torch.zeros(6, dtype=torch.long).index_add_(0, batch["sequence_ids"][mask],
                                                         torch.ones(int(mask.sum()), dtype=torch.long))
    assert counts.tolist() == [4, 2, 2, 3, 4, 2]
    # The trainer's own per-sequence count (trainer/dpo.py), in the blocks' order: every answer token.
    assert scored_tokens(blocks).tolist() == [2, 4, 2, 2, 4, 3, 9, 9]
    assert scored_tokens(pack_pairs(pairs, seq_len, pad_id=0, packing=False)).tolist() == [2, 2, 4, 9, 4, 2, 3, 9]


def test_unpacked_rows_are_the_chosen_then_the_rejected() -> None:
    pairs = [fake(3, 2, 4, 100), fake(2, 5, 1, 200)]
    blocks = pack_pairs(pairs, 8, pad_id=0, packing=False)
    assert blocks.input_ids.shape == (4, 8) and len(blocks) == 2
    assert blocks.seq_pair.tolist() == [0, 1, 0, 1] and blocks.seq_side.tolist() == [CHOSEN, CHOSEN,
                                                                                      REJECTED, REJECTED]
    assert blocks.input_ids[2, :7].tolist() == pairs[0].side(REJECTED)[0]
    assert blocks.attention_mask is not None and blocks.attention_mask.sum(1).tolist() == [5, 7, 7, 3]
    assert blocks.segment_ids[3].tolist() == [0] * 3 + [-1] * 5
    batch = blocks.batch([1])
    assert torch.equal(batch["input_ids"], blocks.input_ids[[1, 3]])
    assert batch["pair_ids"].tolist() == [1, 1] and batch["chosen"].tolist() == [True, False]
    assert batch["sequence_ids"].tolist() == [[0] * 7 + [-1], [1] * 3 + [-1] * 5]
    assert "attention_mask" in batch


def test_a_pair_longer_than_a_row_is_refused_not_split() -> None:
    with pytest.raises(ValueError, match="more than a row of 8"):
        pack_pairs([fake(4, 1, 1, 0)], 4, pad_id=0, packing=True)
    empty = pack_pairs([], 4, pad_id=0, packing=True)
    assert empty.input_ids.shape == (0, 8) and len(empty) == 0
