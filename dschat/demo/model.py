"""Config of the tiny Llama used by the ``tiny`` model preset: small enough to train every stage on a CPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dschat.demo.tokenizer import BOS_ID, EOS_ID, MODEL_MAX_LENGTH, PAD_ID, VOCAB_SIZE

if TYPE_CHECKING:
    from transformers import LlamaConfig


def tiny_model_config(
    vocab_size: int = VOCAB_SIZE,
    pad_token_id: int = PAD_ID,
    bos_token_id: int = BOS_ID,
    eos_token_id: int = EOS_ID,
    num_hidden_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int = 344,
    num_attention_heads: int = 4,
    max_position_embeddings: int = MODEL_MAX_LENGTH,
) -> LlamaConfig:
    """A small ``LlamaConfig`` (about 1.4M parameters with the defaults and the tiny tokenizer).

    Defaults match the tiny tokenizer's vocabulary and special ids. Untied input and output embeddings, as in
    Llama-2. Dropout is zero, so eval and train mode give the same log-probs.
    """
    from transformers import LlamaConfig

    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
