"""What a test checks of a preference-trained model: how it ranks pairs it never saw (scripts/pairs.py makes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.pairs import pairs, write_pairs

__all__ = ["pairs", "ranking_accuracy", "write_pairs"]


def ranking_accuracy(model_dir: Path, held_out: list[dict[str, Any]]) -> float:
    """The share of pairs whose chosen answer the model at `model_dir` finds likelier than the rejected one (summed
    log-probabilities of the answer's tokens after the prompt), loaded as any user would load it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import IGNORE, encode_chat

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logp(prompt: str | list[dict[str, str]], answer: str) -> float:
        # As the trainer renders a pair (trainer/pairs.py): a conversation through encode_chat, labels on the
        # answer's turn; a string prompt and its answer tokenized apart.
        if isinstance(prompt, list):
            ids, labels = encode_chat(tokenizer, [*prompt, {"role": "assistant", "content": answer}])
        else:
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            a = tokenizer(answer, add_special_tokens=False)["input_ids"]
            ids, labels = p + a, [IGNORE] * len(p) + a
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        return float(sum(logits[t - 1, ids[t]] for t in range(1, len(ids)) if labels[t] != IGNORE))

    right = 0
    for pair in held_out:
        if "prompt" in pair:
            prompt, good, bad = pair["prompt"], pair["chosen"], pair["rejected"]
        else:
            prompt = pair["input"]["messages"]
            good, bad = (pair[k][0]["content"] for k in ("preferred_output", "non_preferred_output"))
        right += logp(prompt, good) > logp(prompt, bad)
    return right / len(held_out)
