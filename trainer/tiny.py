"""A tiny Llama and byte-level BPE tokenizer trained on local text: tests and demos cannot download models."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def build_tokenizer(corpus: str, vocab_size: int, max_pos: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Every byte in the initial alphabet: any input text tokenizes, there is never an unknown token.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=max_pos)


def build_tiny_model(out_dir: str | Path, corpus: str, *, vocab_size: int = 384, hidden: int = 64,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, max_pos: int = 1024,
                     seed: int = 0) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus, vocab_size, max_pos)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_pos, bos_token_id=eos_id, eos_token_id=eos_id,
                         pad_token_id=eos_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Build a tiny random Llama + BPE tokenizer from a text file")
    parser.add_argument("--out", required=True)
    parser.add_argument("--corpus", required=True, help="a local text file to train the tokenizer on")
    parser.add_argument("--vocab-size", type=int, default=384)
    args = parser.parse_args()
    corpus = Path(args.corpus).read_text(encoding="utf-8")
    path = build_tiny_model(args.out, corpus, vocab_size=args.vocab_size)
    print(path)


if __name__ == "__main__":
    main()
