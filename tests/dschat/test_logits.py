"""The output layer only where a loss reads it (dschat.logits) and DPO's one-sequence-per-pair layout: the same
log-probs, losses and gradients as the full (B, T, V) logits, on the tiny preset and real demo rows."""

from __future__ import annotations

import pytest
import torch

from dschat.config import DataArgs
from dschat.data import DataCollatorSFT, load_phase
from dschat.data.packing import common_prefix, shared_prefix_inputs, shared_prefix_layout, shared_prefix_mask, unpack
from dschat.demo import demo_data
from dschat.logits import causal_lm_loss, selected_logits
from dschat.rlhf.dpo import DataCollatorPairs, pair_logps, sequence_logps


@pytest.fixture(scope="module")
def tiny():
    from dschat.models import load_tokenizer, resolve_model

    path = resolve_model("tiny")
    return path, load_tokenizer(path)


def _rows(tok, phase, n=6):
    return load_phase(DataArgs(), phase, tok, 1234, log=lambda _: None, default_data=demo_data).train[:n]


def _model(path, attention="sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_selected_logits_are_the_full_logits_at_those_positions(tiny):
    path, tok = tiny
    model = _model(path)
    batch = DataCollatorSFT(tok.pad_token_id)(_rows(tok, 1))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    rows, cols = torch.tensor([0, 0, 3, 5, 1]), torch.tensor([0, 7, 2, 9, 4])
    full = model(**inputs, use_cache=False).logits
    torch.testing.assert_close(selected_logits(model, rows, cols, **inputs), full[rows, cols], atol=1e-5, rtol=0)
    # the hook is gone afterwards: a plain forward gives every position again
    assert model(**inputs, use_cache=False).logits.shape == full.shape


def test_causal_lm_loss_and_gradients_equal_transformers_loss(tiny):
    path, tok = tiny
    batch = DataCollatorSFT(tok.pad_token_id)(_rows(tok, 1))  # the prompt's labels are -100 (mask_prompt)
    assert (batch["labels"] == -100).any() and (batch["labels"] != -100).any()
    a, b = _model(path), _model(path)
    expected = a(**batch, use_cache=False).loss
    expected.backward()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    got = causal_lm_loss(b, batch["labels"], **inputs)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-6, rtol=1e-4)


def test_shared_prefix_layout_by_hand():
    # pair 0: prompt [5, 6], chosen answer [7, 8], rejected [9]; pair 1: prompt [5], chosen [4], rejected [3, 2]
    ids = torch.tensor([[5, 6, 7, 8], [5, 4, 0, 0], [5, 6, 9, 0], [5, 3, 2, 0]])
    mask = (torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]))
    lay = shared_prefix_layout(ids, mask, torch.tensor([2, 1]))
    assert lay["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 0]]
    assert lay["position_ids"].tolist() == [[0, 1, 2, 3, 2], [0, 1, 1, 2, 0]]
    assert lay["part"].tolist() == [[0, 0, 1, 1, 2], [0, 1, 2, 2, -1]]
    # each view position's flat layout position (W = 5; padding -> 0)
    assert lay["index"].tolist() == [[0, 1, 2, 3], [5, 6, 0, 0], [0, 1, 4, 0], [5, 7, 8, 0]]
    assert unpack(lay["input_ids"], lay["index"]).masked_fill(mask == 0, 0).tolist() == ids.tolist()
    m = shared_prefix_mask(lay["part"], "sdpa", torch.float32)[:, 0].int()
    assert m[0].tolist() == [[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0],
                             [1, 1, 0, 0, 1]]  # the rejected answer sees the prompt and itself, not the chosen one
    assert m[1, 4].tolist() == [1, 0, 0, 0, 1]  # padding sees the prompt and itself
    assert common_prefix(ids, mask).tolist() == [2, 1]
    # rows that differ within the prefix are not laid out together
    assert shared_prefix_layout(ids, mask, torch.tensor([3, 1])) is None


def _full_logps(model, b):
    """The reference computation: full logits, log-softmax over the vocabulary, summed over answer tokens."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    t = torch.arange(1, b["input_ids"].shape[1])
    answer = (t[None] >= b["prompt_len"][:, None]) & b["attention_mask"][:, 1:].bool()
    return (logp * answer).sum(-1), answer.sum(-1)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_pair_logps_equal_separate_rows_with_gradients(tiny, attention):
    path, tok = tiny
    b = DataCollatorPairs(tok.pad_token_id)(_rows(tok, 2))
    a, s, p = _model(path, attention), _model(path, attention), _model(path, attention)
    half = len(b["prompt_len"]) // 2
    assert shared_prefix_inputs(p, b["input_ids"], b["attention_mask"], b["prompt_len"][:half]) is not None
    expected, n_expected = _full_logps(a, b)
    rows, n_rows = sequence_logps(s, b["input_ids"], b["attention_mask"], b["prompt_len"])
    shared, n_shared = pair_logps(p, b["input_ids"], b["attention_mask"], b["prompt_len"])
    assert n_rows.tolist() == n_shared.tolist() == n_expected.tolist() and n_expected.min() > 0
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-6)  # sums of ~50 log-probs of about -7
    torch.testing.assert_close(shared, expected, atol=1e-4, rtol=1e-6)
    weights = torch.linspace(-1.0, 1.0, len(expected))  # a loss that weighs every row differently
    for out in (expected, rows, shared):  # each through its own copy of the model
        (out * weights).sum().backward()
    ga, gs, gp = _grads(a), _grads(s), _grads(p)
    for name in ga:
        torch.testing.assert_close(gs[name], ga[name], atol=1e-5, rtol=1e-3)
        torch.testing.assert_close(gp[name], ga[name], atol=1e-5, rtol=1e-3)
