"""Tiny random models of the families users bring, with tokenizers trained here in each family's real style.

``build_family(name, folder)`` writes a causal-LM folder (config, seeded weights, tokenizer) in well under a
second; nothing comes from the Hub. The special tokens, their ids and the chat templates follow what the real
checkpoints ship, because that is what the pipeline has to cope with:

- llama_sp: the ``tiny`` preset (sentencepiece): bos ``<s>``, eos ``</s>``, pad ``<pad>``; no template.
- qwen2: byte-level BPE; no bos; eos ``<|endoftext|>`` = pad; ChatML template; embedding rows past the vocab.
- gpt2: byte-level BPE; bos = eos = unk = ``<|endoftext|>``; no pad; no template.
- opt: byte-level BPE; bos = eos = ``</s>`` (2), pad ``<pad>`` (1), unk ``<unk>`` (3); no template.
- llama3: byte-level BPE; bos ``<|begin_of_text|>`` (the template writes it too), eos ``<|end_of_text|>``,
  ``<|reserved_special_token_N|>``; no pad.
- mistral: sentencepiece-style BPE; ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2; no pad; ``[INST]`` template (writes
  BOS and EOS).
- gemma2: sentencepiece-style BPE; ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3; turn template.

Models: hidden 64, 2 layers, 4 heads (the ``tiny`` preset keeps its own config).

``NAME-tight`` (``TIGHT_FAMILIES``): the same family saved as models are after
``resize_token_embeddings(len(tokenizer))``, or trained small with their own tokenizer: exactly as many embedding
rows as tokens, the tokenizer padding with its EOS, no ``<unk>`` and no pad or reserved special token, so dschat
must add a ``<|pad|>`` past the embedding's rows. (The sentencepiece ``tiny`` preset always has an ``<unk>``, which
dschat pads with, so it has no such variant.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

FAMILIES = ("llama_sp", "qwen2", "gpt2", "opt", "llama3", "mistral", "gemma2")
TIGHT_FAMILIES = ("qwen2", "gpt2", "opt", "llama3", "mistral", "gemma2")

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- message['content'] + '\\n\\n' }}{%- endif %}{%- endfor %}"
)
GEMMA_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

_SUBJECTS = ["my parcel", "the invoice", "our order", "the refund", "your account", "the delivery", "this laptop",
             "the ticket", "my password", "the new phone"]
_VERBS = ["has not arrived", "looks wrong", "was charged twice", "cannot be found", "stopped working",
          "needs an update", "is delayed", "was cancelled"]
_GOOD = ["I am sorry about that; I have checked it and it will be fixed today.",
         "Thanks for waiting. I looked it up and sent you the details by mail.",
         "Sorry for the trouble. The team has it now and will reply within a day.",
         "I checked the record: it is on its way and should arrive tomorrow."]
_BAD = ["No.", "Not my problem.", "Ask someone else.", "I do not know and I do not care."]
_ZH = ["你好，请问我的快递到哪了？", "发票有问题。", "谢谢你的帮助！", "退款什么时候到账？"]


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = f"Hello, {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)}. What can you do?"
        out.append(q if i % 5 else f"{q} {rng.choice(_ZH)}")
    return out


def pairwise_rows(n: int = 48, seed: int = 0) -> list[dict[str, Any]]:
    """Conversational pairwise rows (prompt as messages): families with a chat template render them with it,
    the others with Human/Assistant."""
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": q}], "chosen": rng.choice(_GOOD), "rejected": rng.choice(_BAD)}
            for q in questions(n, seed)]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _training_text() -> list[str]:
    text = questions(200, seed=1) + _GOOD + _BAD + _ZH
    dialogues = zip(questions(50, 2), _GOOD * 13, strict=False)
    return text + [f"\n\nHuman: {q}\n\nAssistant: {a}\n[INST] {q} [/INST] {a}\nuser model" for q, a in dialogues]


def _bpe(style: str, front: list[str], back: list[str], vocab: int) -> Any:
    """A BPE ``tokenizers.Tokenizer``: ``front`` specials take the first ids (OPT, Mistral, Gemma order them so),
    ``back`` ones the ids after the learned vocabulary (GPT-2, Qwen2, Llama-3)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    text = _training_text()
    if style == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # sentencepiece style: spaces become '▁', unknown characters map to <unk>
        tok = Tokenizer(models.BPE(unk_token=front[0] if front[0] == "<unk>" else "<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = sorted(set("".join(text)) | {"▁"})
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=front, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in back])
    return tok


def _with_bos(tok: Any, bos: str) -> None:
    from tokenizers import processors

    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                       special_tokens=[(bos, bos_id)])


def _tight(tok: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A ``-tight`` variant's tokenizer: pad = EOS, no declared unk (the BPE model may keep its own)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "unk_token"}
    return tok, {**kwargs, "pad_token": kwargs["eos_token"]}


def _spare_free(specials: list[str], tight: bool) -> list[str]:
    """Special tokens without the pad and reserved ones dschat would pad with, for a ``-tight`` variant."""
    return [t for t in specials if not tight or not ("pad" in t or "reserved" in t)]


def _tokenizer(family: str, tight: bool = False) -> tuple[Any, dict[str, Any]]:
    """``(tokenizers.Tokenizer, PreTrainedTokenizerFast keyword arguments)`` for ``family``."""
    if tight:
        return _tight(*_tokenizer_specials(family, True))
    return _tokenizer_specials(family, False)


def _tokenizer_specials(family: str, tight: bool) -> tuple[Any, dict[str, Any]]:
    if family == "qwen2":
        tok = _bpe("bytelevel", [], ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 400)
        return tok, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": QWEN_TEMPLATE}
    if family == "gpt2":
        tok = _bpe("bytelevel", [], ["<|endoftext|>"], 400)
        return tok, {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    if family == "opt":
        tok = _bpe("bytelevel", _spare_free(["<s>", "<pad>", "</s>", "<unk>"], tight), [], 400)
        _with_bos(tok, "</s>")
        return tok, {"bos_token": "</s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    if family == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|reserved_special_token_2|>", "<|eot_id|>"]
        tok = _bpe("bytelevel", [], _spare_free(specials, tight), 400)
        _with_bos(tok, "<|begin_of_text|>")
        return tok, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                     "chat_template": LLAMA3_TEMPLATE}
    if family == "mistral":
        tok = _bpe("metaspace", ["<unk>", "<s>", "</s>"], [], 400)
        _with_bos(tok, "<s>")
        return tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": MISTRAL_TEMPLATE}
    if family == "gemma2":
        front = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        tok = _bpe("metaspace", _spare_free(front, tight), [], 400)
        _with_bos(tok, "<bos>")
        return tok, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                     "chat_template": GEMMA_TEMPLATE}
    raise ValueError(family)


def _config(family: str, tok: Any, tight: bool = False, heads: int = 4) -> Any:
    config = _family_config(family, tok, heads)
    if tight:  # exactly the tokenizer's rows; the model pads with EOS, as its tokenizer does
        config.vocab_size = len(tok)
        eos = tok.convert_tokens_to_ids(tok.eos_token)
        bos = tok.convert_tokens_to_ids(tok.bos_token) if tok.bos_token else eos
        config.pad_token_id, config.eos_token_id, config.bos_token_id = eos, eos, bos
    return config


def _family_config(family: str, tok: Any, heads: int = 4) -> Any:
    import transformers as T

    ids = {k: tok.convert_tokens_to_ids(getattr(tok, k.replace("_id", ""))) if getattr(tok, k.replace("_id", ""))
           else None for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": heads, "intermediate_size": 128,
             "max_position_embeddings": 256}
    n = len(tok)
    if family == "qwen2":  # Qwen2.5 rounds the embedding up past the tokenizer (spare rows) and ties it
        return T.Qwen2Config(vocab_size=(n + 63) // 64 * 64, num_key_value_heads=2, tie_word_embeddings=True,
                             bos_token_id=ids["eos_token_id"], eos_token_id=ids["eos_token_id"], **small)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=n, n_embd=64, n_layer=2, n_head=heads, n_positions=256,
                            bos_token_id=ids["eos_token_id"], eos_token_id=ids["eos_token_id"])
    if family == "opt":
        return T.OPTConfig(vocab_size=n, hidden_size=64, num_hidden_layers=2, num_attention_heads=heads, ffn_dim=128,
                           word_embed_proj_dim=64, max_position_embeddings=256, pad_token_id=1, bos_token_id=2,
                           eos_token_id=2)
    if family == "llama3":
        return T.LlamaConfig(vocab_size=n, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
                             bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], **small)
    if family == "mistral":
        return T.MistralConfig(vocab_size=n, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False,
                               bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], **small)
    if family == "gemma2":
        return T.Gemma2Config(vocab_size=n, num_key_value_heads=2, head_dim=64 // heads, sliding_window=128,
                              pad_token_id=0, eos_token_id=1, bos_token_id=2, **small)
    raise ValueError(family)


def build_family(family: str, folder: str | Path, heads: int = 4) -> Path:
    """A causal-LM folder of ``family`` (or ``family-tight``) under ``folder`` (the ``tiny`` preset for
    ``llama_sp``). ``heads`` 2 gives 32-wide heads, the narrowest vLLM's CPU attention runs (4 gives 16)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if family == "llama_sp":
        from dschat.models.loading import resolve_model

        return Path(resolve_model("tiny"))
    out = Path(folder) / (family if heads == 4 else f"{family}-h{heads}")
    if (out / "config.json").exists():
        return out
    name, _, variant = family.partition("-")
    tight = variant == "tight"
    raw, kwargs = _tokenizer(name, tight)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, model_max_length=256, **kwargs)
    config = _config(name, tok, tight, heads)
    rng = torch.random.get_rng_state()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    torch.random.set_rng_state(rng)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
