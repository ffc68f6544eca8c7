"""The short names ``--model`` accepts for common checkpoints, in a module of their own (no torch), so that
``dschat plan`` reads them without loading the model code (``dschat.models.loading`` resolves them)."""

from __future__ import annotations

__all__ = ["ALIASES", "FAMILY_ALIASES"]

# Short names for common checkpoints: alias -> (HF repo, model family it loads). Families whose tokenizer ships
# no pad, or pad == EOS (Qwen2 base, GPT-2, Llama-3), get a distinct pad from ``load_tokenizer``.
FAMILY_ALIASES: dict[str, tuple[str, str]] = {
    "chinese-llama-2-7b": ("hfl/chinese-llama-2-7b", "llama-2"),
    "chinese-llama-2-13b": ("hfl/chinese-llama-2-13b", "llama-2"),
    "chinese-llama-2-1.3b": ("hfl/chinese-llama-2-1.3b", "llama-2"),
    "chinese-alpaca-2-7b": ("hfl/chinese-alpaca-2-7b", "llama-2"),
    "chinese-alpaca-2-1.3b": ("hfl/chinese-alpaca-2-1.3b", "llama-2"),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", "llama-2"),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", "llama-2"),
    "llama-2-7b-chat": ("meta-llama/Llama-2-7b-chat-hf", "llama-2"),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", "llama-3"),
    "llama-3-8b-instruct": ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3"),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "llama-3"),
    "llama-3.2-1b-instruct": ("meta-llama/Llama-3.2-1B-Instruct", "llama-3"),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", "mistral"),
    "mistral-7b-instruct": ("mistralai/Mistral-7B-Instruct-v0.2", "mistral"),
    "gemma-2-2b": ("google/gemma-2-2b", "gemma2"),
    "gemma-2-2b-it": ("google/gemma-2-2b-it", "gemma2"),
    "opt-125m": ("facebook/opt-125m", "opt"),
    "opt-350m": ("facebook/opt-350m", "opt"),
    "opt-1.3b": ("facebook/opt-1.3b", "opt"),
    "opt-6.7b": ("facebook/opt-6.7b", "opt"),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", "qwen2"),
    "qwen2.5-0.5b-instruct": ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2"),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B", "qwen2"),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", "qwen2"),
    "gpt2": ("openai-community/gpt2", "gpt2"),
    "gpt2-medium": ("openai-community/gpt2-medium", "gpt2"),
}
ALIASES: dict[str, str] = {name: repo for name, (repo, _) in FAMILY_ALIASES.items()}
