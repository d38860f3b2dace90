"""What the trainer's MFU figures count (trainer/flops.py): the attention term over the documents attended,
against the reference formula's whole row. Plain functions on the CPU; the GPU figures use the same ones."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from db.ingest import apply_event
from db.models import Job
from trainer import flops
from trainer.data import pack


def test_packed_rows_count_each_document_and_no_padding() -> None:
    # Row 0: documents of 3 and 4 tokens, then the first token of one of 5, which goes on in row 1 (positions
    # restart there: a row is the longest stretch a document attends over); row 1: its 4 tokens, a document of
    # 2, and 2 columns of padding.
    docs = [([1] * 3, [1] * 3), ([2] * 4, [2] * 4), ([3] * 5, [3] * 5), ([4] * 2, [4] * 2)]
    blocks = pack(docs, seq_len=8, pad_id=0, packing=True)
    assert blocks.real_tokens.tolist() == [8, 6]
    pairs = flops.attended_pairs(blocks.position_ids, blocks.real_tokens)
    assert pairs.tolist() == [3**2 + 4**2 + 1**2, 4**2 + 2**2]


def test_unpacked_rows_count_their_real_tokens() -> None:
    blocks = pack([([1] * 5, [1] * 5), ([2] * 12, [2] * 12)], seq_len=8, pad_id=0, packing=False)
    pairs = flops.attended_pairs(blocks.position_ids, blocks.real_tokens, chunk=1)
    assert pairs.tolist() == [25, 64]


def test_the_three_figures_and_what_they_count() -> None:
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4)
    c = flops.counts(config, n_params=1_000_000, seq_len=2048)
    assert (c.dense_per_token, c.attention_per_pair) == (6e6, 12.0 * 4 * 64)
    # 2,048 real tokens in 1 s on a 1e9 FLOP/s device: 16 documents of 128 tokens.
    got = flops.mfu(c, real_tokens=2048, pairs=16 * 128**2, seconds=1.0, peak_total=1e9)
    assert got["mfu_6n"] == pytest.approx(2048 * 6e6 / 1e9)
    assert got["mfu"] == pytest.approx(2048 * (6e6 + 3072 * 2048) / 1e9)  # every token against the whole row
    assert got["mfu_attended"] == pytest.approx(2048 * (6e6 + 3072 * 128) / 1e9)  # against its document
    assert got["mfu_6n"] < got["mfu_attended"] < got["mfu"]
    # Off a known GPU every figure is null, not a guess.
    assert flops.mfu(c, 2048, 1.0, 1.0, None) == dict.fromkeys(flops.MFU_FIELDS)


def test_the_job_row_keeps_every_mfu_figure() -> None:
    j = Job(id="job_x", status="running", attempt=1, progress={}, checkpoints=[], event_seq=0, resolved={})
    apply_event(j, "progress", {"step": 3, "mfu": 0.57, "mfu_6n": 0.515, "mfu_attended": 0.52, "ts": 1.0})
    assert j.progress == {"step": 3, "mfu": 0.57, "mfu_6n": 0.515, "mfu_attended": 0.52}


def test_attended_pairs_is_cheap_on_a_large_set() -> None:
    pos = torch.arange(2048).repeat(3000, 1)
    pos[:, 1000] = 0
    pairs = flops.attended_pairs(pos, torch.full((3000,), 2048))
    assert pairs[0].item() == 1000**2 + 1048**2 and pairs.shape == (3000,)
