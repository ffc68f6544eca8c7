"""The ``tiny`` model preset (docs/models.md, The tiny preset): a small Llama config and the shipped
sentencepiece tokenizer.

``--model tiny`` (``dschat.models.loading.resolve_model``) materialises this config with seeded weights and this
tokenizer into the cache once, so every stage runs on a CPU without downloads. ``assets/tokenizer.model`` is a BPE model
trained on the demo corpus; the demo rebuilds it (``python -m dschat.demo tokenizer``, see
``dschat.demo.tokenizer`` for its settings) and the library only loads it.

``load_tiny_tokenizer`` turns it into a HF tokenizer through ``AutoTokenizer``, which in transformers 5 builds a
``TokenizersBackend`` that follows the sentencepiece model's own settings and gives exactly sentencepiece's ids.
(``LlamaTokenizer(vocab_file=...)`` yields empty ids in transformers 5, and naming ``LlamaTokenizer`` as the class
makes it drop the dummy prefix before a leading space or a ``<think>`` tag.) The one known difference: text that
contains a special token's string (``<s>``, ``</s>``, ``<pad>``, ``<unk>``) is split at it by HF and not by
sentencepiece.

transformers is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerBase

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"  # dschat/assets
TOKENIZER_MODEL_PATH = ASSETS_DIR / "tokenizer.model"

VOCAB_SIZE = 4000
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
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
