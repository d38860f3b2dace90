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

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logp(prompt: str, answer: str) -> float:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + a])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].log_softmax(-1)
        return float(sum(logits[len(p) - 1 + i, t] for i, t in enumerate(a)))

    right = 0
    for pair in held_out:
        if "prompt" in pair:
            prompt, good, bad = pair["prompt"], pair["chosen"], pair["rejected"]
        else:
            prompt = pair["input"]["messages"][-1]["content"]
            good, bad = (" " + pair[k][0]["content"] for k in ("preferred_output", "non_preferred_output"))
        right += logp(prompt, good) > logp(prompt, bad)
    return right / len(held_out)
