"""Model shapes the GPU benchmarks use (random-initialised; only the shapes matter for speed and memory)."""

from __future__ import annotations

from transformers import GPT2Config, LlamaConfig, PretrainedConfig

LLAMA_VOCAB = 128256


def llama(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=LLAMA_VOCAB,
                       max_position_embeddings=4096, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)


def model_config(name: str) -> PretrainedConfig:
    if name == "tiny":  # a CPU smoke test of the scripts: 4 layers, the Llama vocabulary
        return llama(64, 4, 4, 2, 256, True)
    if name == "gpt2":  # GPT-2 124M, positions widened to 2048 as in the reference runs
        return GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=2048, bos_token_id=0, eos_token_id=0)
    shapes = {
        "llama1b": (2048, 16, 32, 8, 8192, True),  # Llama-3.2-1B
        "llama3b": (3072, 28, 24, 8, 8192, True),  # Llama-3.2-3B
        "llama6b": (4096, 24, 32, 8, 14336, False),  # Llama-3.1-8B width, 24 of its 32 layers
        "llama7b": (4096, 28, 32, 8, 14336, False),  # Llama-3.1-8B width, 28 of its 32 layers
        "llama8b": (4096, 32, 32, 8, 14336, False),  # Llama-3.1-8B
        "llama12b": (4096, 52, 32, 8, 14336, False),  # Llama-3.1-8B width, 52 layers: 12.4 B
        "llama13b": (4096, 56, 32, 8, 14336, False),  # Llama-3.1-8B width, 56 layers: 13.3 B
        "llama14b": (4096, 60, 32, 8, 14336, False),  # Llama-3.1-8B width, 60 layers: 14.1 B
        "llama15b": (4096, 64, 32, 8, 14336, False),  # Llama-3.1-8B width, 64 layers: 15.0 B
        "llama32b": (6144, 60, 48, 8, 20480, False),
        "llama45b": (8192, 48, 64, 8, 28672, False),  # Llama-3-70B width, 48 of its 80 layers
        "llama57b": (8192, 64, 64, 8, 28672, False),  # Llama-3-70B width, 64 of its 80 layers
        "llama70b": (8192, 80, 64, 8, 28672, False),  # Llama-3.1-70B
    }
    if name not in shapes:
        raise SystemExit(f"unknown model {name}; known: tiny, gpt2, {', '.join(shapes)}")
    return llama(*shapes[name])
