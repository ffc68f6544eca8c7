"""Embedded demo: generated preference data, a tiny sentencepiece tokenizer and a tiny Llama config.

Everything here runs without network access. ``dschat.demo.corpus`` is pure stdlib; the tokenizer and model
helpers import sentencepiece / transformers only when called.
"""

from dschat.demo.corpus import (
    generate_judge_pairs,
    generate_pairwise,
    generate_prompts,
    tokenizer_training_text,
    write_demo_files,
)
from dschat.demo.model import tiny_model_config
from dschat.demo.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_MODEL_PATH,
    UNK_ID,
    VOCAB_SIZE,
    build_tokenizer_model,
    load_tiny_tokenizer,
    save_tiny_tokenizer,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "TOKENIZER_MODEL_PATH",
    "UNK_ID",
    "VOCAB_SIZE",
    "build_tokenizer_model",
    "generate_judge_pairs",
    "generate_pairwise",
    "generate_prompts",
    "load_tiny_tokenizer",
    "save_tiny_tokenizer",
    "tiny_model_config",
    "tokenizer_training_text",
    "write_demo_files",
]
