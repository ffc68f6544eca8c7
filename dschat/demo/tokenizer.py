"""The tiny demo tokenizer: a sentencepiece BPE model trained on the demo corpus, shipped as a file.

``assets/tokenizer.model`` is built by ``build_tokenizer_model`` from ``corpus.tokenizer_training_text()`` and a
short line of extra punctuation. Rebuild it after changing the corpus templates or the settings below::

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

``load_tiny_tokenizer`` turns it into a HF tokenizer through ``AutoTokenizer``, which in transformers 5 builds
a ``TokenizersBackend`` that follows the sentencepiece model's own settings and gives exactly
sentencepiece's ids. (``LlamaTokenizer(vocab_file=...)`` yields empty ids in transformers 5, and naming
``LlamaTokenizer`` as the class makes it drop the dummy prefix before a leading space or a ``<think>`` tag.) The
one known difference: text that contains a special token's string (``<s>``, ``</s>``, ``<pad>``, ``<unk>``) is
split at it by HF and not by sentencepiece.

sentencepiece and transformers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dschat.demo.corpus import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, tokenizer_training_text
from dschat.utils import atomic_write_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_MODEL_PATH = ASSETS_DIR / "tokenizer.model"

VOCAB_SIZE = 4000
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
MODEL_MAX_LENGTH = 512  # = tiny_model_config's max_position_embeddings

#: Passed to ``AutoTokenizer.from_pretrained`` for the bare ``tokenizer.model``; ``save_pretrained`` then writes
#: them into ``tokenizer_config.json`` / ``tokenizer.json``, so checkpoints reload the same way.
HF_TOKENIZER_KWARGS: dict[str, Any] = {
    "unk_token": UNK_TOKEN,
    "bos_token": BOS_TOKEN,
    "eos_token": EOS_TOKEN,
    "pad_token": PAD_TOKEN,
    "add_bos_token": True,
    "add_eos_token": False,
    "model_max_length": MODEL_MAX_LENGTH,
}

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


def load_tiny_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tiny tokenizer as a HF tokenizer.

    ``path=None`` loads the shipped ``assets/tokenizer.model``. Otherwise ``path`` is a tokenizer folder: one
    written by ``save_tiny_tokenizer``, any stage checkpoint, or a folder holding just a ``tokenizer.model``
    (then the special tokens of ``HF_TOKENIZER_KWARGS`` are applied). Needs ``protobuf`` for the conversion.
    """
    from transformers import AutoTokenizer

    folder = ASSETS_DIR if path is None else Path(path)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    if not (folder / "tokenizer.model").is_file():
        raise FileNotFoundError(f"no tokenizer.json, tokenizer_config.json or tokenizer.model in {folder}")
    return AutoTokenizer.from_pretrained(folder, **HF_TOKENIZER_KWARGS)


def save_tiny_tokenizer(out_dir: str | Path) -> Path:
    """Write the tiny tokenizer as a HF tokenizer folder (``save_pretrained`` files + ``tokenizer.model``).

    Returns ``out_dir``; ``load_tiny_tokenizer(out_dir)`` or ``AutoTokenizer.from_pretrained(out_dir)`` reload it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_tiny_tokenizer().save_pretrained(out)
    # transformers 5 saves only tokenizer.json; keep the sentencepiece model too, for tools that want it.
    shutil.copyfile(TOKENIZER_MODEL_PATH, out / "tokenizer.model")
    return out
