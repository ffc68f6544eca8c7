"""How the ``tiny`` preset's tokenizer is made: a sentencepiece BPE model trained on the demo corpus.

The library ships the result as ``dschat/assets/tokenizer.model`` and loads it (``dschat.models.tiny``); this module
builds it with ``build_tokenizer_model`` from ``corpus.tokenizer_training_text()`` and a short line of extra
punctuation. Rebuild it after changing the corpus templates or the settings below::

    python -m dschat.demo tokenizer

``tests/dschat/test_demo.py`` rebuilds it and checks the result equals the shipped file byte for byte (with the
installed sentencepiece; another sentencepiece version may train a different model).

Settings and why:

- ``model_type="bpe"``: what Llama tokenizers use; transformers' converters handle it best.
- ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False``: with the default NFKC rule
  sentencepiece rewrites full-width ``，。！`` and the HF tokenizer would not, so ids would disagree; and runs of
  spaces or newlines stay as they are, like Llama's tokenizer.
- ``add_dummy_prefix=True`` (Llama's choice), ``split_digits=True`` (numbers tokenized digit by digit, which
  the arithmetic prompts need), ``byte_fallback=True`` (an unseen character becomes UTF-8 byte pieces, never
  ``<unk>``), ``character_coverage=1.0`` (every character of the corpus gets its own piece).
- ids: unk 0, bos 1, eos 2, pad 3; then ``<think> </think> <answer> </answer>`` as user-defined symbols (always
  one piece each), the 256 byte pieces, and the learned merges.
- ``num_threads=1``, a fixed random seed, an in-memory iterator and writer (no file paths end up in the
  model's trainer spec): the same corpus gives the same bytes.

sentencepiece is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dschat.demo.corpus import tokenizer_training_text
from dschat.models.tiny import (
    BOS_ID,
    BOS_TOKEN,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    TOKENIZER_MODEL_PATH,
    UNK_ID,
    UNK_TOKEN,
    VOCAB_SIZE,
)
from dschat.prompts import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN
from dschat.utils import atomic_write_bytes

SPECIAL_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

# Common punctuation the templates do not use, so it gets a piece of its own instead of 3 byte pieces.
_COVERAGE_TEXT = (
    "（）《》【】「」『』〈〉“”‘’、；：…—～·￥％＃＆＊＋－＝／＼｜＠ "
    "!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~"
)


def _training_text(seed: int) -> Iterator[str]:
    yield from tokenizer_training_text(seed)
    yield _COVERAGE_TEXT


def _trainer_kwargs(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "model_type": "bpe",
        "character_coverage": 1.0,
        "byte_fallback": True,
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "add_dummy_prefix": True,
        "split_digits": True,
        "allow_whitespace_only_pieces": True,
        "unk_id": UNK_ID,
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "pad_id": PAD_ID,
        "unk_piece": UNK_TOKEN,
        "bos_piece": BOS_TOKEN,
        "eos_piece": EOS_TOKEN,
        "pad_piece": PAD_TOKEN,
        "user_defined_symbols": list(SPECIAL_TAGS),
        "num_threads": 1,
        "input_sentence_size": 0,  # use every sentence: no sampling
        "shuffle_input_sentence": False,
        "max_sentence_length": 1 << 16,
        "minloglevel": 2,  # quiet
    }


def build_tokenizer_model_bytes(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> bytes:
    """Train the tiny sentencepiece model on the demo corpus of ``seed``; returns the serialized model."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_text(seed), model_writer=buf, **_trainer_kwargs(vocab_size)
    )
    return buf.getvalue()


def build_tokenizer_model(
    out_path: str | Path = TOKENIZER_MODEL_PATH, vocab_size: int = VOCAB_SIZE, seed: int = 0
) -> Path:
    """Rebuild ``tokenizer.model`` deterministically from the demo corpus and write it to ``out_path``.

    The write is atomic (temporary file + rename). The default path is the shipped asset.
    """
    return atomic_write_bytes(out_path, build_tokenizer_model_bytes(vocab_size, seed))
