"""The output layer only where a loss reads it (dschat.models.logits) and DPO's one-sequence-per-pair layout: the same
log-probs, losses and gradients as the full (B, T, V) logits, on the tiny preset and real demo rows."""

from __future__ import annotations

import pytest
import torch

from dschat.config import DataArgs
from dschat.data import DataCollatorSFT, load_phase
from dschat.data.packing import common_prefix, shared_prefix_inputs, shared_prefix_layout, shared_prefix_mask, unpack
from dschat.demo import demo_data
from dschat.models.logits import causal_lm_loss, selected_logits
from dschat.rlhf.dpo import DataCollatorPairs, pair_logps, sequence_logps


@pytest.fixture(scope="module")
def tiny():
    from dschat.models.loading import load_tokenizer, resolve_model

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


def test_alibi_models_run_pairs_row_by_row_and_refuse_packing(tiny):
    """Bloom derives positions from a 2-D attention mask (ALiBi): the shared-prefix layout would break it, so its
    pairs run one by one (same log-probs as sequence_logps) and --packing is refused with one line."""
    from transformers import BloomConfig, BloomForCausalLM

    from dschat.data.packing import check_packing
    from dschat.errors import UserError

    _, tok = tiny
    b = DataCollatorPairs(tok.pad_token_id)(_rows(tok, 2, n=3))
    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=2, n_head=4)).eval()
    half = len(b["prompt_len"]) // 2
    assert shared_prefix_inputs(model, b["input_ids"], b["attention_mask"], b["prompt_len"][:half]) is None
    with torch.no_grad():
        rows = sequence_logps(model, b["input_ids"], b["attention_mask"], b["prompt_len"])[0]
        pairs = pair_logps(model, b["input_ids"], b["attention_mask"], b["prompt_len"])[0]
    assert torch.equal(pairs, rows)
    with pytest.raises(UserError, match="--packing: bloom derives token positions"):
        check_packing(model, 256)


def test_short_prefix_before_long_answers_runs_row_by_row():
    """One sequence per pair costs attention W^2 for the rows' a^2 + b^2: with a one-token prompt before long
    answers that would nearly double it, so the rows run one by one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    ids = torch.randint(3, 50, (2, 40))
    ids[1, :20] = ids[0, :20]  # two 40-token rows that share their first 20 tokens
    mask = torch.ones_like(ids)
    # a 1-token prefix: W = 79, 79^2 > 1.25 * (40^2 + 40^2); the layout itself exists, but is not used
    assert shared_prefix_layout(ids, mask, torch.tensor([1])) is not None
    assert shared_prefix_inputs(model, ids, mask, torch.tensor([1])) is None
    # the 20-token prefix: W = 60, 60^2 <= 1.25 * 3200
    assert shared_prefix_inputs(model, ids, mask, torch.tensor([20])) is not None


def test_moe_router_loss_kept_in_sft():
    """Mixture-of-experts models with output_router_logits add the router's auxiliary loss to transformers'
    causal-LM loss; causal_lm_loss keeps it."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                             router_aux_loss_coef=0.5)).eval()
    ids = torch.randint(3, 50, (2, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    want = model(input_ids=ids, labels=labels, use_cache=False).loss
    assert causal_lm_loss(model, labels, input_ids=ids).item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_group_completions_share_their_prompt_with_the_same_logprobs(tiny, attention):
    """GRPO's G completions of a prompt run with the prompt once (rollout.shared_prompt_inputs): answer log-probs and
    gradients equal a full forward of the rows one by one; rows ending at different steps, an answer dropped as
    too short and left-padded prompts of different lengths included."""
    from dschat.rlhf.rollout import answer_logprobs, make_rollout, positions_from_mask, shared_prompt_inputs

    path, tok = tiny
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(5, 200, (2, 7), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompts[1, :3], prompt_mask[1, :3] = tok.pad_token_id, 0  # the second prompt is 4 tokens, left-padded
    G, A, eos = 4, 6, tok.eos_token_id
    answers = torch.randint(5, 200, (2 * G, A), generator=g)
    answers[0, 2] = eos  # ends after 3 tokens
    answers[5, 0] = eos  # one token: dropped by min_answer_len 2
    rollout, dropped = make_rollout(prompts.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0),
                                    torch.cat([prompts.repeat_interleave(G, 0), answers], 1), eos,
                                    tok.pad_token_id)
    assert dropped == 1
    a, b = _model(path, attention), _model(path, attention)
    shared = shared_prompt_inputs(b, rollout)
    assert shared is not None and shared[0]["input_ids"].shape[0] < 2 * G  # some rows share a sequence
    logits = a(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
               position_ids=positions_from_mask(rollout.attention_mask), use_cache=False).logits
    P = rollout.prompt_len
    full = logits[:, P - 1: -1].float().log_softmax(-1).gather(-1, rollout.sequences[:, P:, None]).squeeze(-1)
    expected = full * rollout.action_mask
    got = answer_logprobs(b, rollout)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    weights = torch.linspace(-1.0, 1.0, expected.numel()).view_as(expected)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    ga, gb = _grads(a), _grads(b)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], atol=1e-5, rtol=1e-3)
