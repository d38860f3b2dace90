"""What the trainer's MFU figures count: the one place their definitions live.

Every figure is model FLOPs per second over the devices' dense bf16 peak (`recipe.PEAK_BF16_FLOPS`, times the
ranks), counted on real (non-padding) tokens only, over the window since the previous `progress` event. With N
the model's parameters (embeddings included), L its layers, H its hidden size, S the row length (`seq_len`):

- `mfu`: (6N + 12·L·H·S) per real token. The reference scripts' formula (PaLM, appendix B): the dense matrix
  products forward and backward, plus attention of every token over all S positions of its row. Kept unchanged
  so that figures compare with earlier ones and with other trainers'; for packed rows it over-counts, since
  this trainer attends only within each document (~140 tokens on the benchmark's data, not 2,048).
- `mfu_6n`: 6N per real token, the dense matrix products alone; no attention counted.
- `mfu_attended`: 6N per real token plus 12·L·H·d² per document, d the real tokens of each document as a row
  holds it (a packed row's segment, where positions restart at 0; an unpacked row's real tokens): attention
  counted over the keys each token actually attends.

Both attention terms count the whole d×d (S×S) score and value products, as the reference formula does; causal
kernels skip about half of them, so neither is a count of the FLOPs the attention kernel executed. On the
benchmark's Llama-3.2-1B shape the full-row term is ~10% of `mfu`; the attended one is ~1% of `mfu_attended`.
Off a known GPU all three are null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MFU_FIELDS = ("mfu", "mfu_6n", "mfu_attended")


@dataclass(frozen=True)
class FlopCounts:
    dense_per_token: float  # 6N
    attention_per_pair: float  # 12·L·H: one query token against one key, forward + backward
    seq_len: int

    @property
    def full_row_per_token(self) -> float:
        return self.dense_per_token + self.attention_per_pair * self.seq_len


def counts(model_config: Any, n_params: int, seq_len: int) -> FlopCounts:
    layers = getattr(model_config, "num_hidden_layers", 0) or 0
    hidden = getattr(model_config, "hidden_size", 0) or 0
    return FlopCounts(6.0 * n_params, 12.0 * layers * hidden, seq_len)


def attended_pairs(position_ids: torch.Tensor, real_tokens: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Per row, Σ d² over its documents: d a document's real tokens in the row. A document starts at column 0
    and wherever the position restarts at 0; padding (the columns from `real_tokens` on) counts for none."""
    n, seq = position_ids.shape
    out = torch.zeros(n, dtype=torch.float64)
    cols = torch.arange(seq)
    for lo in range(0, n, chunk):
        pos, real = position_ids[lo:lo + chunk], real_tokens[lo:lo + chunk]
        m = pos.shape[0]
        starts = pos == 0
        starts[:, 0] = True
        segment = starts.long().cumsum(dim=1) - 1  # 0, 0, 1, 1, 1, ... per row
        flat = (torch.arange(m).unsqueeze(1) * seq + segment)[cols.unsqueeze(0) < real.unsqueeze(1)]
        lengths = torch.bincount(flat, minlength=m * seq).view(m, seq).double()
        out[lo:lo + m] = (lengths * lengths).sum(dim=1)
    return out


def mfu(c: FlopCounts, real_tokens: float, pairs: float, seconds: float,
        peak_total: float | None) -> dict[str, float | None]:
    """The three figures for `real_tokens` trained in `seconds`, whose documents hold `pairs` = Σ d²."""
    if not peak_total or seconds <= 0:
        return dict.fromkeys(MFU_FIELDS)
    rate = 1.0 / (seconds * peak_total)
    return {"mfu": c.full_row_per_token * real_tokens * rate,
            "mfu_6n": c.dense_per_token * real_tokens * rate,
            "mfu_attended": (c.dense_per_token * real_tokens + c.attention_per_pair * pairs) * rate}
