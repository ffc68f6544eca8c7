"""Model shapes and parameter counts from a model's config alone: no weights, no torch, no transformers.

``model_shape(name)`` reads the ``config.json`` of a local model folder (``dschat.models.folders``: the
folders training accepts), of a model in the HF cache, or of the built-in table ``KNOWN_CONFIGS`` (the fields that
shape each alias's model, copied from its published ``config.json``), so every alias of ``dschat.models.loading``
plans offline. ``tiny`` is the preset of ``dschat.models.tiny``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dschat.errors import UserError
from dschat.models.heads import head_dim as head_width

# The shaping fields of each alias's published config.json (HF id -> fields), plus a few larger models for plans
# at DeepSpeed-Chat's scale. Fields absent from a config take the family's default (``shape_from_config``).
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    # Llama-2 (Touvron et al. 2023): untied embeddings, SwiGLU, RMSNorm, no biases
    "meta-llama/Llama-2-7b-hf": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                                 "vocab_size": 32000, "tie_word_embeddings": False},
    "meta-llama/Llama-2-13b-hf": {"model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40,
                                  "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824,
                                  "vocab_size": 32000, "tie_word_embeddings": False},
    # Chinese-LLaMA-2 / Alpaca-2 (Cui et al. 2023): Llama-2 with a 55,296-token vocabulary; 1.3B is 4 layers of 7B
    "hfl/chinese-llama-2-7b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                               "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                               "vocab_size": 55296, "tie_word_embeddings": False},
    "hfl/chinese-llama-2-13b": {"model_type": "llama", "hidden_size": 5120, "num_hidden_layers": 40,
                                "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824,
                                "vocab_size": 55296, "tie_word_embeddings": False},
    "hfl/chinese-llama-2-1.3b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 4,
                                 "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                                 "vocab_size": 55296, "tie_word_embeddings": False},
    # Llama-3 (Grattafiori et al. 2024): grouped-query attention, 128K vocabulary; 3.2-1B ties its embeddings
    "meta-llama/Meta-Llama-3-8B": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                   "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                   "vocab_size": 128256, "tie_word_embeddings": False},
    "meta-llama/Llama-3.2-1B": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
                                "vocab_size": 128256, "tie_word_embeddings": True, "head_dim": 64},
    "mistralai/Mistral-7B-v0.1": {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
                                  "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                  "vocab_size": 32000, "tie_word_embeddings": False},
    # Gemma-2: head_dim 256 (not hidden / heads), four norms per layer, tied 256K vocabulary
    "google/gemma-2-2b": {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                          "intermediate_size": 9216, "vocab_size": 256000, "tie_word_embeddings": True},
    # OPT (Zhang et al. 2022): learned positions (2 extra rows), biases, LayerNorm, ReLU MLP, tied head
    "facebook/opt-125m": {"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "ffn_dim": 3072, "vocab_size": 50272,
                          "max_position_embeddings": 2048, "word_embed_proj_dim": 768},
    "facebook/opt-350m": {"model_type": "opt", "hidden_size": 1024, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "ffn_dim": 4096, "vocab_size": 50272,
                          "max_position_embeddings": 2048, "word_embed_proj_dim": 512,
                          "do_layer_norm_before": False},
    "facebook/opt-1.3b": {"model_type": "opt", "hidden_size": 2048, "num_hidden_layers": 24,
                          "num_attention_heads": 32, "ffn_dim": 8192, "vocab_size": 50272,
                          "max_position_embeddings": 2048, "word_embed_proj_dim": 2048},
    "facebook/opt-6.7b": {"model_type": "opt", "hidden_size": 4096, "num_hidden_layers": 32,
                          "num_attention_heads": 32, "ffn_dim": 16384, "vocab_size": 50272,
                          "max_position_embeddings": 2048, "word_embed_proj_dim": 4096},
    "facebook/opt-13b": {"model_type": "opt", "hidden_size": 5120, "num_hidden_layers": 40,
                         "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272,
                         "max_position_embeddings": 2048, "word_embed_proj_dim": 5120},
    "facebook/opt-30b": {"model_type": "opt", "hidden_size": 7168, "num_hidden_layers": 48,
                         "num_attention_heads": 56, "ffn_dim": 28672, "vocab_size": 50272,
                         "max_position_embeddings": 2048, "word_embed_proj_dim": 7168},
    "facebook/opt-66b": {"model_type": "opt", "hidden_size": 9216, "num_hidden_layers": 64,
                         "num_attention_heads": 72, "ffn_dim": 36864, "vocab_size": 50272,
                         "max_position_embeddings": 2048, "word_embed_proj_dim": 9216},
    # Qwen2.5: GQA with q/k/v biases; the small ones tie their embeddings
    "Qwen/Qwen2.5-0.5B": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
                          "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
                          "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-1.5B": {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28,
                          "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960,
                          "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen/Qwen2.5-7B": {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
                        "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                        "vocab_size": 152064, "tie_word_embeddings": False},
    # GPT-2 (Radford et al. 2019): learned positions, biases, GELU MLP of 4 x hidden, tied head
    "openai-community/gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                              "vocab_size": 50257, "n_positions": 1024},
    "openai-community/gpt2-medium": {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16,
                                     "vocab_size": 50257, "n_positions": 1024},
}
# Same architecture and shape as another entry (chat and instruct variants, and the alpaca models).
SAME_SHAPE = {
    "meta-llama/Llama-2-7b-chat-hf": "meta-llama/Llama-2-7b-hf",
    "meta-llama/Meta-Llama-3-8B-Instruct": "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistralai/Mistral-7B-v0.1",
    "google/gemma-2-2b-it": "google/gemma-2-2b",
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen/Qwen2.5-0.5B",
    "hfl/chinese-alpaca-2-7b": "hfl/chinese-llama-2-7b",
    "hfl/chinese-alpaca-2-1.3b": "hfl/chinese-llama-2-1.3b",
}
# The learned-position families (OPT keeps 2 extra rows for its padding offset).
POSITION_OFFSET = {"opt": 2, "gpt2": 0, "gpt_neox": None, "llama": None}


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know of a transformer: its dimensions and the layout details that change the
    parameter count (``gated`` MLP, ``biases`` on attention and MLP, LayerNorm with bias or RMSNorm, learned
    positions, tied LM head, OPT's embedding projection)."""

    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    gated: bool = True  # SwiGLU/GeGLU: three MLP matrices; else two (ReLU/GELU)
    attn_bias: str = "none"  # "none", "qkv" (Qwen2), "all" (OPT, GPT-2: q, k, v and output)
    mlp_bias: bool = False
    layernorm_bias: bool = False  # LayerNorm (weight + bias) rather than RMSNorm (weight)
    norms_per_layer: int = 2
    final_norm: bool = True
    positions: int = 0  # rows of a learned position table (0: rotary)
    embed_proj: int = 0  # OPT-350m: embeddings of this width, projected in and out of the hidden size

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attn_bias == "qkv":
            attn += self.q_dim + 2 * self.kv_dim
        elif self.attn_bias == "all":
            attn += self.q_dim + 2 * self.kv_dim + h
        mlp = (3 if self.gated else 2) * h * self.intermediate
        if self.mlp_bias:
            mlp += self.intermediate * (2 if self.gated else 1) + h
        norms = self.norms_per_layer * h * (2 if self.layernorm_bias else 1)
        return attn + mlp + norms

    def embedding_params(self) -> int:
        """Token (and position) embeddings, OPT's projections and the final norm: everything but the blocks and
        an untied LM head."""
        width = self.embed_proj or self.hidden
        n = self.vocab * width + self.positions * self.hidden
        if self.embed_proj:
            n += 2 * self.embed_proj * self.hidden  # project_in and project_out, no bias
        if self.final_norm:
            n += self.hidden * (2 if self.layernorm_bias else 1)
        return n

    def lm_head_params(self) -> int:
        return 0 if self.tied else self.vocab * (self.embed_proj or self.hidden)

    def params(self, head: str = "lm") -> int:
        """Parameters of the causal LM (``head="lm"``) or of the reward/critic model (``head="value"``: the
        backbone plus a ``Linear(hidden, 1, bias=False)`` value head, no LM head)."""
        backbone = self.embedding_params() + self.layers * self.layer_params()
        return backbone + (self.lm_head_params() if head == "lm" else self.hidden)

    def largest_module_params(self, head: str = "lm") -> int:
        """The largest single module's own parameters (ZeRO-3 gathers one at a time): the embedding matrix, the
        LM head, or an MLP projection."""
        embed = self.vocab * (self.embed_proj or self.hidden)
        return max(embed, self.lm_head_params() if head == "lm" else 0, self.hidden * self.intermediate,
                   self.hidden * self.q_dim)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def shape_from_config(config: dict[str, Any], name: str = "") -> ModelShape:
    """A ``ModelShape`` from the fields of a HF ``config.json`` (Llama, Mistral, Qwen2, Gemma/Gemma-2, OPT, GPT-2,
    and any config that names ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    ``intermediate_size`` the Llama way)."""
    kind = str(config.get("model_type", "llama"))
    try:
        if kind == "gpt2":
            h, layers, heads = int(config["n_embd"]), int(config["n_layer"]), int(config["n_head"])
            return ModelShape(name, kind, h, layers, heads, heads, h // heads,
                              int(config.get("n_inner") or 4 * h), int(config["vocab_size"]),
                              bool(config.get("tie_word_embeddings", True)), gated=False, attn_bias="all",
                              mlp_bias=True, layernorm_bias=True, positions=int(config.get("n_positions", 1024)))
        h, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        head_dim = int(head_width(config) or h // heads)
        vocab = int(config["vocab_size"])
        if kind == "opt":
            proj = int(config.get("word_embed_proj_dim") or h)
            return ModelShape(name, kind, h, layers, heads, heads, head_dim, int(config["ffn_dim"]), vocab,
                              bool(config.get("tie_word_embeddings", True)), gated=False, attn_bias="all",
                              mlp_bias=True, layernorm_bias=True,
                              final_norm=bool(config.get("do_layer_norm_before", True)),
                              positions=int(config.get("max_position_embeddings", 2048)) + 2,
                              embed_proj=proj if proj != h else 0)
        inter = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{name or 'model'}: config.json lacks a field the planner needs ({e})") from None
    tied = bool(config.get("tie_word_embeddings", kind.startswith("gemma")))
    return ModelShape(name, kind, h, layers, heads, kv, head_dim, inter, vocab, tied,
                      attn_bias="qkv" if kind in ("qwen2",) else ("all" if config.get("attention_bias") else "none"),
                      mlp_bias=bool(config.get("mlp_bias", False)), norms_per_layer=4 if kind == "gemma2" else 2)


def alias_repos() -> dict[str, str]:
    """Alias -> HF id (``dschat.models.aliases``, a module without torch)."""
    from dschat.models.aliases import ALIASES

    return dict(ALIASES)


def tiny_config() -> dict[str, Any]:
    """The ``tiny`` preset's config fields (``dschat.models.tiny.tiny_model_config``'s defaults), without
    transformers."""
    import inspect

    from dschat.models.tiny import VOCAB_SIZE, tiny_model_config

    d = {k: p.default for k, p in inspect.signature(tiny_model_config).parameters.items()}
    return {"model_type": "llama", "hidden_size": d["hidden_size"], "num_hidden_layers": d["num_hidden_layers"],
            "num_attention_heads": d["num_attention_heads"], "num_key_value_heads": d["num_attention_heads"],
            "intermediate_size": d["intermediate_size"], "vocab_size": VOCAB_SIZE, "tie_word_embeddings": False}


def _hf_cache_config(repo: str) -> Path | None:
    """The ``config.json`` of ``repo`` in the HF hub cache, if a snapshot there has one."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    snapshots = Path(hub) / f"models--{repo.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None


def model_config(name: str) -> tuple[dict[str, Any], str]:
    """``(config fields, where they came from)`` for ``--model``-style ``name``: ``tiny``, a local model folder
    (as training resolves it), an alias or HF id in the cache, else the built-in table."""
    if name == "tiny":
        return tiny_config(), "tiny preset"
    from dschat.models.folders import local_model_folder

    path = local_model_folder(name)  # the loader's rule: what training refuses, the plan refuses
    if path is not None:
        return _read_json(path / "config.json"), str(path)
    repo = alias_repos().get(name.lower(), name)
    cached = _hf_cache_config(repo)
    if cached is not None:
        return _read_json(cached), f"HF cache ({repo})"
    known = KNOWN_CONFIGS.get(SAME_SHAPE.get(repo, repo))
    if known is None:
        lowered = {k.lower(): k for k in (*KNOWN_CONFIGS, *SAME_SHAPE)}
        key = lowered.get(repo.lower())
        known = KNOWN_CONFIGS.get(SAME_SHAPE.get(key, key)) if key else None
    if known is None:
        raise UserError(f"model {name!r}: no local folder, no config.json in the HF cache, and not in the planner's "
                        f"table of published shapes; pass a folder holding its config.json")
    return dict(known), f"built-in table ({repo})"


def model_shape(name: str) -> ModelShape:
    """The ``ModelShape`` of ``--model``-style ``name`` (see ``model_config``)."""
    config, _ = model_config(name)
    return shape_from_config(config, name)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read config.json ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: config.json is not a mapping")
    return data
