"""Model resolution and builders: causal LMs (actor/reference/SFT) and reward models (reward/critic).

``resolve_model`` turns ``--model`` into a local folder: a folder as given, an alias (``chinese-llama-2-7b``), a
HF id found in the local cache, or the preset ``tiny`` (a small Llama with the demo tokenizer, materialised once
into the dschat cache). Offline and absent gives one clear line, never a download attempt that hangs.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import pickle
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dschat.devices import forked_rng, prefer_attention_kernels
from dschat.errors import UserError
from dschat.models.aliases import ALIASES, FAMILY_ALIASES  # noqa: F401 (FAMILY_ALIASES: re-exported)
from dschat.models.folders import local_model_folder
from dschat.models.lora import apply_lora
from dschat.models.reward_model import RewardModel
from dschat.models.tiny import TOKENIZER_MODEL_PATH, save_tiny_tokenizer, tiny_model_config
from dschat.utils import atomic_dir, cache_root, stable_hash

if TYPE_CHECKING:
    from dschat.config import LoraArgs


# Files a model download fetches: config, tokenizer and weights. Weights as safetensors when the repository has
# them, else as PyTorch ``*.bin`` (older OPT/GPT-2 style repos), which transformers reads with
# ``torch.load(weights_only=True)``: tensors only, never arbitrary pickled objects.
CONFIG_PATTERNS = ["*.json", "*.model", "*.txt", "*.py", "*.tiktoken", "*.jinja"]
SAFETENSORS_PATTERNS = ["*.safetensors"]
BIN_PATTERNS = ["pytorch_model*.bin"]

# The pad dschat adds when a tokenizer has no usable one (pad missing or equal to EOS) and no spare special token.
PAD_TOKEN = "<|pad|>"

TINY = "tiny"


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def tiny_model_dir() -> Path:
    """Materialise the ``tiny`` preset (config, seeded weights, demo tokenizer) once; return its folder."""
    # The folder name covers everything that shapes the preset, so a changed tokenizer or config never
    # reuses a stale folder.
    digest = stable_hash([hashlib.sha256(Path(TOKENIZER_MODEL_PATH).read_bytes()).hexdigest(),
                          inspect.getsource(tiny_model_config), "v1"])
    final = cache_root() / f"tiny-{digest}"
    if (final / "config.json").exists():
        return final
    _quiet_transformers()
    try:
        _build_tiny(final)
    except _NoWeights:
        # Under a launcher transformers writes weights from the main process only: another rank's copy came out
        # without them and was discarded, so wait for the main process's (it builds the same folder).
        deadline = time.time() + 600
        while not (final / "config.json").exists():
            if time.time() > deadline:
                raise UserError(f"{final}: the tiny preset was not built by the main process within 10 minutes") \
                    from None
            time.sleep(0.5)
    return final


def _build_tiny(final: Path) -> None:
    """Build the tiny preset into ``final`` atomically (``_NoWeights`` when this process's copy had none)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    with atomic_dir(final, replace=False) as tmp:
        save_tiny_tokenizer(tmp)
        tok = AutoTokenizer.from_pretrained(tmp)
        config = tiny_model_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        with forked_rng(0):  # the preset's weights are the same everywhere; the caller's streams stay put
            model = LlamaForCausalLM(config)
        model.save_pretrained(tmp)
        if not (tmp / "config.json").is_file():
            raise _NoWeights  # atomic_dir discards this copy


class _NoWeights(Exception):
    """A tiny-preset build whose ``save_pretrained`` wrote nothing (not the main process of a launched run)."""


def resolve_model(name: str) -> str:
    """A local folder for ``--model``: folder, alias, HF cache, or the ``tiny`` preset."""
    if name == TINY:
        return str(tiny_model_dir())
    path = local_model_folder(name)  # the planner's rule too
    if path is not None:
        return str(path)
    repo = ALIASES.get(name.lower(), name)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache; maybe downloadable
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    hint = f" (alias of {repo})" if repo != name else ""
    if not offline:
        try:
            return snapshot_download(repo, allow_patterns=download_patterns(repo))
        except Exception as e:  # noqa: BLE001
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise UserError(f"model {name!r}{hint} is not a local folder nor in the HF cache, and downloading "
                            f"it failed: {reason}") from None
    raise UserError(f"model {name!r}{hint} is not a local folder nor in the HF cache, and HF_HUB_OFFLINE is set; "
                    f"download it first (huggingface-cli download {repo}) or pass a local path")


def local_model_type(name: str) -> str | None:
    """The ``model_type`` of a local model folder's config.json (the ``tiny`` preset is a Llama), read without
    loading anything; None for a name that is not such a folder (an alias, an HF name): the loader resolves and
    reports those."""
    if name == TINY:
        return "llama"
    try:
        kind = json.loads((Path(name).expanduser() / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def download_patterns(repo: str) -> list[str]:
    """What ``resolve_model`` downloads from ``repo``: config and tokenizer files, and the weights as
    safetensors, or as ``pytorch_model*.bin`` when the repository publishes no safetensors."""
    try:
        from huggingface_hub import list_repo_files

        files = list_repo_files(repo)
    except Exception:  # noqa: BLE001 - listing failed: ask for both, the download reports what is missing
        return CONFIG_PATTERNS + SAFETENSORS_PATTERNS + BIN_PATTERNS
    has_safetensors = any(f.endswith(".safetensors") for f in files)
    return CONFIG_PATTERNS + (SAFETENSORS_PATTERNS if has_safetensors else BIN_PATTERNS)


# Subfolders of a stage's output folder that hold its model: stage 3's actor/, stages 1 and 2's model/.
STAGE_MODEL_DIRS = ("actor", "model")
# Config fields that hold the longest sequence a model was built for, by family (Llama/OPT/Qwen, GPT-2, ...).
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def resolve_saved_model(model: str, inside: tuple[str, ...] = STAGE_MODEL_DIRS) -> str:
    """``resolve_model``, where a stage output folder stands for the model inside it (the first of ``inside``
    that holds a config.json), so ``--model output/step3_rlhf`` works."""
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        for sub in inside:
            if (path / sub / "config.json").exists():
                return str(path / sub)
    return resolve_model(model)


def max_positions(config: Any, tokenizer: Any) -> int | None:
    """The longest sequence (prompt + answer) the model takes, or None when neither config nor tokenizer says."""
    for name in POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel (int(1e30)); that is not a limit.
    return value if isinstance(value, int) and 0 < value < 1_000_000 else None


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer, with a pad token that is not EOS (``ensure_distinct_pad``)."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{path}: cannot load tokenizer ({str(e).strip().splitlines()[0][:200]})") from None
    ensure_distinct_pad(tok)
    return tok


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers give every token the same id and end with the same EOS (so ids, and next-token
    distributions over them, mean the same thing for both models)."""
    if a is b:
        return True
    return a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id


def ensure_distinct_pad(tok: Any) -> None:
    """Give ``tok`` a pad token other than EOS, in place, when it has none or pad == EOS (Qwen2 base, GPT-2,
    Llama-3 ship so).

    Why: dschat's end score is the value at the EOS that ends every input (found from the attention mask), and
    HF's ``*ForSequenceClassification`` pools at the last token that is not ``config.pad_token_id``. The two
    agree exactly when pad != EOS, so every stage pads with, and every saved folder (tokenizer and config)
    carries, such a pad. Which one, first found: unk (Llama-2, Mistral); a special token already in the vocab
    that is meant for padding or reserved (``<|finetune_right_pad_id|>``, ``<|reserved_special_token_0|>``);
    else a new ``<|pad|>`` (GPT-2), for which the model's embedding grows by a row (``fit_embeddings``). The
    choice depends on the tokenizer alone, so every stage makes the same one, and once saved it is kept.
    Padding is marked by attention masks everywhere in dschat, so the pad's id never changes a number."""
    eos = tok.eos_token_id
    if tok.pad_token_id is not None and tok.pad_token_id != eos:
        return
    if tok.unk_token is not None and tok.unk_token_id not in (None, eos):
        tok.pad_token = tok.unk_token
        return
    avoid = {eos, tok.bos_token_id}
    added = sorted(getattr(tok, "added_tokens_decoder", {}).items())
    spare = [(i, t.content) for i, t in added if getattr(t, "special", False) and i not in avoid
             and any(word in t.content.lower() for word in ("pad", "reserved"))]
    spare.sort(key=lambda it: "pad" not in it[1].lower())  # a token meant for padding before a reserved one
    if spare:
        tok.pad_token = spare[0][1]
    else:
        tok.add_special_tokens({"pad_token": PAD_TOKEN})


def fit_embeddings(model: Any, n_tokens: int) -> None:
    """Grow ``model``'s token embeddings (and an untied LM head) to ``n_tokens`` rows when the tokenizer has
    more ids than the model (the ``<|pad|>`` of ``ensure_distinct_pad``). New rows are the mean of the old ones:
    deterministic (no random draw) and, as an output row, no likelier than an average token."""
    old = model.get_input_embeddings().num_embeddings
    if n_tokens <= old:
        return
    model.resize_token_embeddings(n_tokens, mean_resizing=False)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            if layer is not None and layer.weight.shape[0] == n_tokens:
                layer.weight[old:] = layer.weight[:old].mean(0)


def _pad_now(config: Any, pad: int | None) -> int | None:
    """Name ``pad`` in ``config`` before the model is built, where the embedding already has its row; return it
    when it does not (a new ``<|pad|>`` past the rows of a model saved with exactly its tokenizer's vocabulary,
    e.g. after ``resize_token_embeddings(len(tokenizer))``), to be named once ``fit_embeddings`` has grown the
    embedding: families build ``nn.Embedding(vocab, h, padding_idx=config.pad_token_id)``, which refuses an id past
    its rows. Until then the config keeps its own pad, or none if that is out of range too."""
    if pad is None:
        return None
    rows = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if isinstance(rows, int) and pad >= rows:
        own = getattr(config, "pad_token_id", None)
        if isinstance(own, int) and own >= rows:
            config.pad_token_id = None
        return pad
    config.pad_token_id = pad
    return None


def _finish(hf: nn.Module, model: nn.Module, n_tokens: int, late_pad: int | None, lora: LoraArgs | None,
            gradient_checkpointing: bool) -> None:
    """What both builders do to a loaded HF model ``hf`` (``model``: it, or the module wrapping it): embedding rows
    for every tokenizer id, then the pad named (``_pad_now``), LoRA adapters, gradient checkpointing."""
    fit_embeddings(hf, n_tokens)
    if late_pad is not None:
        hf.config.pad_token_id = late_pad
    if lora is not None and lora.lora_dim:
        apply_lora(model, lora)
    if gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.config.use_cache = False


@contextlib.contextmanager
def _refuse_pickles(path: str) -> Iterator[None]:
    """A ``pytorch_model.bin`` holding anything but tensors is refused (``weights_only``), as one clear line."""
    try:
        yield
    except pickle.UnpicklingError:
        raise UserError(f"{path}: its pytorch_model*.bin holds more than tensors, so it was not unpickled; "
                        "convert a trusted copy to safetensors") from None


def _tokenizer_facts(path: str, trust_remote_code: bool) -> tuple[int, int | None]:
    """``(len, pad id)`` of dschat's tokenizer for the model folder ``path`` (a folder without a tokenizer
    keeps its own config)."""
    try:
        tok = load_tokenizer(path, trust_remote_code)
    except UserError:
        return 0, None
    return len(tok), tok.pad_token_id


def load_failure(path: str, e: BaseException) -> UserError:
    """One line for a model folder that does not load: remote code not trusted, damaged weights, other errors."""
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if "trust_remote_code" in str(e):
        return UserError(f"{path}: this model needs its own Python code (auto_map in config.json) to load; pass "
                         "--trust-remote-code if you trust that code (it runs it)")
    from dschat.integrity import damaged_safetensors

    damaged = damaged_safetensors(path) if Path(path).is_dir() else None
    if damaged is not None:
        return UserError(f"{damaged[0]}: damaged weights ({damaged[1]}); copy or download the model again")
    return UserError(f"{path}: cannot load the model ({type(e).__name__}: {first})")


# What loading a model folder raises when the folder, not the program, is at fault (SafetensorError is an
# Exception of its own).
_LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError)


def _load_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError

        return (*_LOAD_ERRORS, SafetensorError)
    except ImportError:
        return _LOAD_ERRORS


def _apply_dropout(config: Any, dropout: float | None) -> None:
    if dropout is None:
        return
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop")):
            setattr(config, key, dropout)


def create_causal_lm(path: str, dtype: torch.dtype = torch.float32, dropout: float | None = None,
                     gradient_checkpointing: bool = False, trust_remote_code: bool = False,
                     lora: LoraArgs | None = None) -> nn.Module:
    """A HF causal LM; with ``lora`` (``lora_dim`` > 0) PEFT LoRA adapters are injected (``dschat.models.lora``).
    Every model dschat loads comes through here or ``create_reward_model``, so both apply the process's attention
    policy (``dschat.devices.prefer_attention_kernels``): the commands that only sample or score never set up a
    training process group, where it is applied as well."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    prefer_attention_kernels()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        _apply_dropout(config, dropout)
        n_tokens, pad = _tokenizer_facts(path, trust_remote_code)
        late = _pad_now(config, pad)  # the saved config names the pad the saved tokenizer pads with
        with _refuse_pickles(path):
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, weights_only=True,
                                                         trust_remote_code=trust_remote_code)
    except _load_errors() as e:
        raise load_failure(path, e) from None
    _finish(model, model, n_tokens, late, lora, gradient_checkpointing)
    return model


def create_reward_model(path: str, dtype: torch.dtype = torch.float32, dropout: float | None = None,
                        gradient_checkpointing: bool = False, pad_token_id: int | None = None,
                        trust_remote_code: bool = False, lora: LoraArgs | None = None) -> RewardModel:
    """A reward/critic model from a causal-LM folder (fresh v_head) or a saved reward model (trained v_head).

    With ``lora`` (``lora_dim`` > 0) the backbone gets PEFT LoRA adapters and the v_head stays fully trainable.
    Applies the attention policy as ``create_causal_lm`` does.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    _quiet_transformers()
    prefer_attention_kernels()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except _load_errors() as e:
        raise load_failure(path, e) from None
    _apply_dropout(config, dropout)
    config.num_labels = 1
    n_tokens, pad = _tokenizer_facts(path, trust_remote_code)
    if pad_token_id is None:
        pad_token_id = pad
    # HF's pooling takes the last token != this id: with a pad distinct from EOS that is the EOS, where dschat's end
    # score is (``ensure_distinct_pad``), so the saved folder scores as dschat does.
    late = _pad_now(config, pad_token_id)
    try:
        with _refuse_pickles(path):
            seq_cls = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype,
                                                                         weights_only=True,
                                                                         trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e) or "sequence" not in str(e).lower():
            raise load_failure(path, e) from None
        raise UserError(f"{path}: this model family has no sequence-classification head in transformers "
                        f"({str(e).splitlines()[0][:120]})") from None
    except _load_errors() as e:
        raise load_failure(path, e) from None
    model = RewardModel(seq_cls)
    _finish(seq_cls, model, n_tokens, late, lora, gradient_checkpointing)
    return model


def frozen_causal_lm(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> Any:
    """A saved causal LM as a frozen engine on this process's device (no sharding): what the evaluation and sampling
    commands score or sample with. A folder without a loadable causal LM is a one-line error."""
    from dschat import engine as E  # here, not above: dschat.engine imports deepspeed (start-up cost)

    try:
        lm = create_causal_lm(path, dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot load a causal LM ({str(e).strip().splitlines()[0][:200]})") from None
    return E.build_eval_engine(lm, zero_stage=0, offload=False, dtype=dtype)


def frozen_reward_model(path: str, dtype: torch.dtype, pad_token_id: int, trust_remote_code: bool = False) -> Any:
    """A saved reward model (stage 2's output) as a frozen engine on this process's device (no sharding)."""
    from dschat import engine as E  # here, not above: dschat.engine imports deepspeed (start-up cost)

    model = create_reward_model(path, dtype, 0.0, False, pad_token_id, trust_remote_code)
    return E.build_eval_engine(model, zero_stage=0, offload=False, dtype=dtype)
