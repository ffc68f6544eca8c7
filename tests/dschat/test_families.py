"""The families users bring, unit by unit (docs/models.md, Aliases and families): the pad every tokenizer gets,
HF score parity of a reward model, one decoded row per family (template, one BOS, the EOS), aliases, and weights
published as ``pytorch_model.bin``. The end-to-end runs are in ``tests/test_family_matrix.py``."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch

from dschat.config import DataArgs
from dschat.data import DataCollatorReward, load_phase
from dschat.errors import UserError
from dschat.models.loading import PAD_TOKEN, create_causal_lm, create_reward_model, load_tokenizer
from tests.families import FAMILIES, TIGHT_FAMILIES, build_family, pairwise_rows, write_rows

ROOT = Path(__file__).resolve().parents[2]

# The pad each family gets, and whether it is new to the vocab (only when no spare token exists).
PADS = {"llama_sp": ("<pad>", False), "qwen2": (PAD_TOKEN, True), "gpt2": (PAD_TOKEN, True),
        "opt": ("<pad>", False), "llama3": ("<|reserved_special_token_0|>", False), "mistral": ("<unk>", False),
        "gemma2": ("<pad>", False)}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    data = write_rows(root / "pairs.jsonl", pairwise_rows(12))
    return {name: build_family(name, root) for name in FAMILIES}, data


@pytest.mark.parametrize("name", TIGHT_FAMILIES)
def test_models_without_spare_embedding_rows_get_a_new_pad_row(name, tmp_path):
    """A model with exactly as many embedding rows as tokens, whose tokenizer pads with EOS and has no unk, pad or
    reserved token: dschat adds ``<|pad|>`` past the rows. Both builders (every stage, eval, generate, chat, judge
    and export load through them) grow the embedding by that row and name the pad in the config only once the row
    exists; before, families whose embedding takes ``padding_idx`` from the config crashed while loading."""
    path = str(build_family(f"{name}-tight", tmp_path))
    tok = load_tokenizer(path)
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == len(tok) - 1 != tok.eos_token_id
    ids = torch.tensor([[5, 6, 7, tok.eos_token_id], [8, 9, tok.eos_token_id, tok.pad_token_id]])
    mask = (ids != tok.pad_token_id).long()
    lm = create_causal_lm(path)
    rm = create_reward_model(path, pad_token_id=tok.pad_token_id)
    for model in (lm, rm.model):
        assert model.get_input_embeddings().num_embeddings == len(tok)
        assert model.config.pad_token_id == tok.pad_token_id
    with torch.no_grad():
        assert torch.isfinite(lm(input_ids=ids, attention_mask=mask).logits).all()
        assert torch.isfinite(rm(ids, mask)).all()


def _rows(tok, data, phase):
    args = DataArgs(data=[str(data)], data_split="0,1,0" if phase == 2 else "1,1,1", eval_fraction=0,
                    max_seq_len=128)
    return load_phase(args, phase, tok, 0, use_cache=False, log=lambda _: None).train


@pytest.mark.parametrize("name", FAMILIES)
def test_every_tokenizer_pads_with_a_token_other_than_eos(families, name, tmp_path):
    from transformers import AutoTokenizer

    folder = families[0][name]
    shipped = AutoTokenizer.from_pretrained(folder)
    tok = load_tokenizer(str(folder))
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.pad_token == PADS[name][0]
    assert len(tok) == len(shipped) + PADS[name][1]
    assert {k: v for k, v in tok.get_vocab().items() if k != PAD_TOKEN} == \
        {k: v for k, v in shipped.get_vocab().items() if k != PAD_TOKEN}  # no id changes meaning
    tok.save_pretrained(tmp_path)  # a saved tokenizer keeps its pad: every later stage makes the same choice
    again = load_tokenizer(str(tmp_path))
    assert (again.pad_token_id, len(again)) == (tok.pad_token_id, len(tok))
    model = create_causal_lm(str(folder))
    assert model.get_input_embeddings().num_embeddings >= len(tok)
    assert model.config.pad_token_id == tok.pad_token_id


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_sequence_classification_scores_equal_the_end_score(families, name, tmp_path):
    """A reward model saved by dschat, loaded with AutoModelForSequenceClassification: padded batches (dschat's
    and its own tokenizer's) and single rows score as dschat's end score, to 1e-5."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dschat.training.checkpoint import save_hf

    folder, data = families
    tok = load_tokenizer(str(folder[name]))
    rows = _rows(tok, data, 2)[:4]
    rm = create_reward_model(str(folder[name]), pad_token_id=tok.pad_token_id).eval()
    with torch.no_grad():
        rm.v_head.weight.copy_(torch.linspace(-1, 1, rm.v_head.weight.numel()).view_as(rm.v_head.weight))
    save_hf(rm, tok, tmp_path / "rm")
    batch = DataCollatorReward(tok.pad_token_id)(rows)
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    seqs = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
    assert all(s[-1] == tok.eos_token_id for s in seqs)  # inputs end with EOS: the scored token
    with torch.no_grad():
        ours = rm.end_scores(rm(batch["input_ids"], batch["attention_mask"]), batch["attention_mask"])
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        own = hf(**hf_tok.pad({"input_ids": seqs}, return_tensors="pt")).logits.squeeze(-1)
        single = torch.stack([hf(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs])
    assert ours.abs().max() > 0.01  # a head that scores something
    for got in (theirs, own, single):
        torch.testing.assert_close(got, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_one_row_per_family_decodes_with_its_template_one_bos_and_the_eos(families, name):
    """Stage 1 rows of message prompts: the family's template (Human/Assistant without one), the prompt masked,
    one BOS at most, the answer trained through the EOS even where EOS is also BOS or the shipped pad. Stage 2
    rows end with the EOS; stage 3, ``dschat chat`` and the judge tokenize a prompt alike."""
    from dschat.generation.chat import encode_prompt
    from dschat.rewards.judge import encode_prompts

    folder, data = families
    tok = load_tokenizer(str(folder[name]))
    row = _rows(tok, data, 1)[0]
    ids, labels = row["input_ids"], row["labels"]
    n_prompt = sum(1 for x in labels if x == -100)
    prompt, answer = tok.decode(ids[:n_prompt]), tok.decode(ids[n_prompt:])
    markers = {"qwen2": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>",
               "mistral": "[/INST]", "gemma2": "<start_of_turn>model\n"}
    assert prompt.rstrip().endswith(markers.get(name, "Assistant:").rstrip())
    assert labels[n_prompt:] == ids[n_prompt:] and n_prompt > 0
    assert ids[-1] == tok.eos_token_id and labels[-1] == tok.eos_token_id
    assert answer.count(tok.eos_token) == 1 and answer.endswith(tok.eos_token)
    if tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id:
        assert ids.count(tok.bos_token_id) <= 1
    if tok.bos_token_id is not None and tok(" x")["input_ids"][0] == tok.bos_token_id:
        assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    if name == "qwen2":
        assert prompt.startswith("<|im_start|>system\n") and "<|im_end|>\n" in answer  # ChatML end of turn kept
    pair = _rows(tok, data, 2)[0]
    assert pair["chosen_input_ids"][-1] == pair["rejected_input_ids"][-1] == tok.eos_token_id
    messages = pairwise_rows(12)[0]["prompt"]
    stage3 = _rows(tok, data, 3)
    want = next(r["prompt_input_ids"] for r in stage3 if r["where"].endswith(":1"))
    assert encode_prompt(messages, tok) == want
    assert encode_prompts(tok, [messages], None)[0][0] == want


@pytest.mark.parametrize("name", ["qwen2", "gpt2", "opt"])
def test_eos_is_trained_with_the_shipped_tokenizer_where_eos_is_also_pad_or_bos(families, name):
    """Stage 1 marks padding by the mask and labels, never by id: with the tokenizer as shipped (Qwen2 pads with
    its EOS, GPT-2 and OPT begin with it) every row's final EOS is a trained label and padding is not."""
    from transformers import AutoTokenizer

    from dschat.data import DataCollatorSFT

    folder, data = families
    shipped = AutoTokenizer.from_pretrained(folder[name])
    eos = shipped.eos_token_id
    rows = _rows(shipped, data, 1)[:4]
    batch = DataCollatorSFT(eos)(rows)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        assert batch["labels"][i, n - 1] == eos and batch["attention_mask"][i, :n].all()
        assert (batch["labels"][i, n:] == -100).all() and not batch["attention_mask"][i, n:].any()
        assert batch["labels"][i, 0] == -100  # the prompt (and a leading BOS) is masked


def test_aliases_name_their_family_and_the_docs_list_them():
    from dschat.models.loading import ALIASES, FAMILY_ALIASES

    readme = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    for alias, (repo, family) in FAMILY_ALIASES.items():
        assert ALIASES[alias] == repo and family
        assert re.search(rf"\| `{re.escape(alias)}` \| `{re.escape(repo)}` \| {re.escape(family)} \|", readme), alias


def test_download_takes_bin_weights_only_when_a_repo_has_no_safetensors(monkeypatch):
    import huggingface_hub

    from dschat.models.loading import download_patterns

    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda repo: ["config.json", "model.safetensors", "pytorch_model.bin"])
    assert "*.safetensors" in download_patterns("a/b") and not any(".bin" in p for p in download_patterns("a/b"))
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: ["config.json", "pytorch_model.bin"])
    assert "pytorch_model*.bin" in download_patterns("a/b") and "*.safetensors" not in download_patterns("a/b")


class _Payload:
    """Unpickling this runs code: what a hostile ``pytorch_model.bin`` carries."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path(self.path).touch, ())


def test_models_published_as_pytorch_model_bin_load_and_pickled_code_never_runs(families, tmp_path):
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(families[0]["gpt2"])
    src.save_pretrained(tmp_path / "bin")  # then republished the old way, as a pickled state dict
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(src.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    load_tokenizer(str(families[0]["gpt2"])).save_pretrained(tmp_path / "bin")
    assert (tmp_path / "bin" / "pytorch_model.bin").exists()
    assert not list((tmp_path / "bin").glob("*.safetensors"))
    lm = create_causal_lm(str(tmp_path / "bin"))
    torch.testing.assert_close(lm.transformer.h[0].attn.c_attn.weight, src.transformer.h[0].attn.c_attn.weight)
    assert create_reward_model(str(tmp_path / "bin")).v_head.weight.shape[1] == 64

    marker = tmp_path / "pwned"
    state = {k: v for k, v in src.state_dict().items()}
    state["x"] = _Payload(str(marker))  # type: ignore[assignment]
    with open(tmp_path / "bin" / "pytorch_model.bin", "wb") as f:
        torch.save(state, f, pickle_module=pickle)
    with pytest.raises(UserError, match="not unpickled"):
        create_causal_lm(str(tmp_path / "bin"))
    assert not marker.exists()
