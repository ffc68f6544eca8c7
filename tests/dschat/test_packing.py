"""Packed batches (--packing) and length-grouped batching (--group-by-length): packing by hand, and packed losses
equal to the unpacked ones (SFT token-mean cross-entropy, the reward model's pairwise and last-token losses, DPO)
on the tiny preset and real demo rows."""

from __future__ import annotations

import pytest
import torch

from dschat.config import DataArgs
from dschat.data import DataCollatorReward, DataCollatorSFT, load_phase
from dschat.data.packing import (
    LengthGroupedSampler,
    attention_balance,
    best_capacity,
    block_causal_mask,
    pack,
    pack_rows,
    sft_inputs,
    shared_prompt_groups,
    unpacked_rows,
)
from dschat.demo import demo_data


def test_best_fit_decreasing_by_hand():
    # longest first: 8 -> new bin 0 (room 2); 6 -> new bin 1 (room 4); 5 -> new bin 2 (room 5); 3 -> the fullest
    # bin it fits, bin 1 (room 4 -> 1); 2 -> bin 0 (room 2 -> 0); 1 -> bin 1 (room 1 -> 0)
    assert pack([5, 3, 8, 2, 6, 1], 10) == [[2, 3], [4, 1, 5], [0]]
    assert pack([12, 1], 10) == [[0], [1]]  # too long for any bin: a bin of its own
    assert pack([], 10) == []


def test_best_capacity_by_hand():
    # four 105-token rows under --max-seq-len 256: two sequences of 256 (512 tokens, 302 padding) or of 210 (420,
    # none); 105 tokens, one row each, ties with 210 and the longer length is kept
    assert best_capacity([105] * 4, 256) == 210
    # 100, 60, 50 under 160: three sequences of 100 (300 tokens), or two from 110 on (100 | 60 + 50: 220 at 110)
    assert best_capacity([100, 60, 50], 160) == 110
    assert best_capacity([300, 20], 256) == 256  # a row longer than the limit: the limit
    assert best_capacity([], 256) == 256
    lengths = [70 + (i * 37) % 52 for i in range(500)]  # 70-121 tokens, like the benchmark's SFT rows
    c = best_capacity(lengths, 256)
    assert max(lengths) <= c < 256 and len(pack(lengths, c)) * c < len(pack(lengths, 256)) * 256


def test_shared_prompt_groups_by_hand():
    # two prompts (50 and 30 tokens) with four 64-token answers each; unshared, 8 rows of 50 + 64 = 114.
    # Cost n * (W + W^2 / balance) at balance 1570: W 114 (8 rows) 978.2, W 178 (pairs: 4) 792.7, W 306 (each
    # prompt's four answers: 2 sequences) 731.3, the least; its mask area 2 * 306^2 is under 2x 8 * 114^2.
    rows_of, p_len, a_len = [[0, 1, 2, 3], [4, 5, 6, 7]], [50] * 4 + [30] * 4, [64] * 8
    assert shared_prompt_groups(rows_of, p_len, a_len, 1570.0, 114) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the mask area capped at 1.3x the rows' (135,158): W 306 (187,272) is out, pairs at W 178 (126,736) remain
    assert shared_prompt_groups(rows_of, p_len, a_len, 1570.0, 114, area_cap=1.3) == [[0, 1], [2, 3], [4, 5],
                                                                                       [6, 7]]
    # attention dear (balance 100): the rows as they are, 8 x (114 + 130.0) = 1951.7, beat every grouping (pairs at
    # W 178: 1979.4; W 158: 2445.8; W 306: 2484.7), so they stay as they are
    assert shared_prompt_groups(rows_of, p_len, a_len, 100.0, 114) is None
    # ... unless the rows as they are run wider: a 150-token prompt budget (unshared 8 x (214 + 458.0) = 5375.7)
    assert shared_prompt_groups(rows_of, p_len, a_len, 100.0, 214) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # no sequence wider than a 200-token sliding window: W 178 (pairs) is the widest left
    assert shared_prompt_groups(rows_of, p_len, a_len, 1570.0, 114, max_width=200) == [[0, 1], [2, 3], [4, 5],
                                                                                        [6, 7]]
    # rows of a prompt in any order, 40 + 20 tokens each: W 60 (6 rows) 373.8, W 80 (pairs, 4 sequences) 336.3, W 100
    # (3 + 1: 4) 425.5, W 120 (3 sequences) 387.5; a prompt seen once keeps its row to itself
    assert shared_prompt_groups([[5, 0, 7, 2], [1], [3]], [40] * 8, [20] * 8, 1570.0, 60) == [[5, 0], [7, 2], [1],
                                                                                            [3]]
    assert shared_prompt_groups([[0], [1]], [40, 40], [20, 20], 1570.0, 60) is None
    # an answer dropped as too short (no action tokens) still opens its own prompt's sequence
    assert shared_prompt_groups([[0, 1], [2, 3]], [40] * 4, [20, 20, 0, 20], 1570.0, 60) == [[0, 1], [2, 3]]


def test_attention_balance_from_the_config():
    from transformers import LlamaConfig

    class Model(torch.nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.config = LlamaConfig(**kw)

    # the bench's model: linear 2*256*12*64 + 2*4*64*256 + 6*256*704 = 1,605,632 FLOPs per token, attention 4*4*64
    # per key: 1,568; Llama-2-7B's shapes: 404,750,336 / 16,384 = 24,704
    assert attention_balance(Model(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                   intermediate_size=704)) == pytest.approx(1568.0)
    assert attention_balance(Model(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                                   intermediate_size=11008)) == pytest.approx(24704.0)


def test_block_causal_mask_keeps_each_row_to_itself():
    seg = torch.tensor([[0, 0, 1, 1, 1, 2]])  # rows of 2 and 3 tokens, then one padding token
    m = block_causal_mask(seg, "sdpa", torch.float32)[0, 0].int()
    assert m.tolist() == [[1, 0, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0, 0],
                          [0, 0, 1, 0, 0, 0],
                          [0, 0, 1, 1, 0, 0],
                          [0, 0, 1, 1, 1, 0],
                          [0, 0, 0, 0, 0, 1]]
    eager = block_causal_mask(seg, "eager", torch.float32)[0, 0]
    assert torch.equal(eager == 0, m.bool()) and eager.min() == torch.finfo(torch.float32).min
    assert block_causal_mask(seg, "flash_attention_2", torch.float32) is None  # rows come from position ids


def test_length_grouped_batches_hold_rows_of_similar_length():
    lengths = [5, 1, 8, 3, 7, 2, 6, 4, 9]  # row i has length lengths[i]
    s = LengthGroupedSampler(lengths, batch_size=2, num_replicas=1, rank=0, seed=0)
    batches = s.batches()
    # one mega-batch sorted longest first: (9, 8), (7, 6), (5, 4), (3, 2), then the partial (1,), kept last
    assert sorted(sorted(lengths[i] for i in b) for b in batches[:-1]) == [[2, 3], [4, 5], [6, 7], [8, 9]]
    assert [lengths[i] for i in batches[-1]] == [1]
    assert sorted(s) == list(range(9)) and len(s) == 9
    s.set_epoch(1)
    assert s.batches() != batches  # another shuffle each epoch
    # two ranks: 8 rows (one dropped, as DistributedSampler(drop_last=True)), each rank half of every batch
    ranks = [LengthGroupedSampler(lengths, 2, 2, r, seed=0) for r in (0, 1)]
    a, b = list(ranks[0]), list(ranks[1])
    assert len(a) == len(b) == 4 and not set(a) & set(b)
    for x, y in zip(a[::2], b[::2], strict=True):  # the first rows of both ranks' batches: one global batch
        assert abs(lengths[x] - lengths[y]) <= 3


@pytest.fixture(scope="module")
def tiny():
    from dschat.models.loading import load_tokenizer, resolve_model

    path = resolve_model("tiny")
    return path, load_tokenizer(path)


def _rows(tok, phase, n=11, **data):
    return load_phase(DataArgs(**data), phase, tok, 1234, log=lambda _: None, default_data=demo_data).train[:n]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mask_prompt", [True, False])
def test_packed_sft_loss_equals_the_padded_one(tiny, attention, mask_prompt):
    from transformers import AutoModelForCausalLM

    path, tok = tiny
    rows = _rows(tok, 1, mask_prompt=mask_prompt)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()
    collator = DataCollatorSFT(tok.pad_token_id)
    padded = collator(rows)
    packs = pack_rows(rows, 200, collator.pack_length)
    packed = collator.packed()(packs)
    assert len(packs) < len(rows) and packed["input_ids"].shape[1] <= 200
    assert int(packed["num_tokens"]) == int(padded["attention_mask"].sum())
    assert (packed["labels"] != -100).sum() == (padded["labels"][:, 1:] != -100).sum()  # the same targets
    a = model(**sft_inputs(model, padded), use_cache=False).loss
    b = model(**sft_inputs(model, packed), use_cache=False).loss
    assert b.item() == pytest.approx(a.item(), abs=1e-5)


@pytest.fixture(scope="module")
def reward_model(tiny):
    from dschat.models.loading import create_reward_model

    path, tok = tiny
    torch.manual_seed(0)
    rm = create_reward_model(path, pad_token_id=tok.pad_token_id).eval()
    torch.nn.init.normal_(rm.v_head.weight, std=0.5)  # a random head: scores that differ
    return rm


@pytest.mark.parametrize("rm_loss", ["pairwise", "last-token"])
def test_packed_reward_losses_equal_the_padded_ones(tiny, reward_model, rm_loss):
    from dschat.training.reward import reward_loss, reward_values

    _, tok = tiny
    collator = DataCollatorReward(tok.pad_token_id)
    packs = pack_rows(_rows(tok, 2), 300, collator.pack_length)
    rows = unpacked_rows(packs)  # the packed batch's rows in its order: the same (2B, T) view
    padded, packed = collator(rows), collator.packed()(packs)
    assert len(packs) < len(rows)
    assert torch.equal(packed["input_ids"], padded["input_ids"])
    with torch.no_grad():
        # the rows one by one; the packed sequences; one sequence per pair with its shared prefix once (the default)
        va = reward_model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
        vb, vc = reward_values(reward_model, packed), reward_values(reward_model, padded)
    real = padded["attention_mask"].bool()
    torch.testing.assert_close(vb[real], va[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(vc[real], va[real], atol=1e-5, rtol=0)
    a = reward_loss(va, padded, rm_loss)
    for other in (reward_loss(vb, packed, rm_loss), reward_loss(vc, padded, rm_loss)):
        assert other.loss.item() == pytest.approx(a.loss.item(), abs=1e-5)
        torch.testing.assert_close(other.chosen_scores, a.chosen_scores, atol=1e-5, rtol=0)  # chosen, rejected apart
        torch.testing.assert_close(other.rejected_scores, a.rejected_scores, atol=1e-5, rtol=0)
    assert not torch.allclose(a.chosen_scores, a.rejected_scores)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_packed_dpo_loss_equals_the_padded_one(tiny, loss_type):
    from transformers import AutoModelForCausalLM

    from dschat.rlhf.dpo import DataCollatorPairs, DPOArgs, packed_sequence_logps, pair_loss, sequence_logps

    path, tok = tiny
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = _rows(tok, 2)
    for i, r in enumerate(rows):  # the reference's summed log-probs, as DPO stores them in the rows
        r["ref_chosen_logps"], r["ref_rejected_logps"] = -40.0 - i, -45.0 + 0.5 * i
    collator = DataCollatorPairs(tok.pad_token_id)
    packs = pack_rows(rows, 300, collator.pack_length)
    padded, packed = collator(unpacked_rows(packs)), collator.packed()(packs)
    with torch.no_grad():
        la, na = sequence_logps(model, padded["input_ids"], padded["attention_mask"], padded["prompt_len"])
        lb, nb = packed_sequence_logps(model, packed)
    assert torch.equal(na, nb) and na.min() > 0
    torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-6)  # sums of ~100 log-probs of about -7
    args = DPOArgs(dpo_loss_type=loss_type)
    a = pair_loss(args, la, na, padded["ref_logps"])
    b = pair_loss(args, lb, nb, packed["ref_logps"])
    assert b.loss.item() == pytest.approx(a.loss.item(), abs=1e-5)


def test_sliding_windows_shorter_than_a_row_refuse_packing():
    from transformers import MistralConfig, MistralForCausalLM

    from dschat.data.packing import check_packing
    from dschat.errors import UserError

    small = {"vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 32}
    model = MistralForCausalLM(MistralConfig(sliding_window=64, **small))
    with pytest.raises(UserError, match="sliding window of 64 tokens, shorter than --max-seq-len 256"):
        check_packing(model, 256)
    check_packing(model, 64)  # no row is longer than the window
    check_packing(MistralForCausalLM(MistralConfig(sliding_window=None, **small)), 256)


@pytest.mark.parametrize("flag", ["packing", "group_by_length"])
def test_stage_runs_with_packed_or_grouped_batches(tmp_path, flag):
    """Stage 1 and stage 2 train with the flag (the loss falls, the reward model learns); a packed stage-1 step
    holds more rows, so the same number of steps covers more of the data."""
    from dschat.config import RewardConfig, SFTConfig, build_config
    from tests.helpers import read_jsonl
    from tests.helpers import run_stage as run

    common = {"model": "tiny", "progress": False, "max_eval_rows": 16, "per_device_train_batch_size": 4, flag: True}
    sft = run(build_config(SFTConfig, {**common, "output_dir": str(tmp_path / "sft"), "max_steps": 12}))
    assert sft["train_loss_last"] < sft["train_loss_first"] - 0.5 and sft["perplexity"] < sft["perplexity_before"]
    tokens = [r["train/tokens_per_s"] for r in read_jsonl(tmp_path / "sft" / "metrics.jsonl") if "train/loss" in r]
    assert len(tokens) == 12
    rm = run(build_config(RewardConfig, {**common, "output_dir": str(tmp_path / "rm"), "max_steps": 8}))
    assert rm["accuracy"] > rm["accuracy_before"] and rm["train_loss_last"] < rm["train_loss_first"]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama_sp", "qwen2", "gpt2", "opt", "llama3", "mistral", "gemma2"])
def test_packed_logits_equal_padded_ones_in_every_family(family_dir, family):
    """Every family of tests/families.py, sdpa and eager: the packed rows' logits are the padded rows' logits
    (OPT, for one, builds its mask without the position ids, so the explicit 4-D mask is what keeps rows apart)."""
    from transformers import AutoModelForCausalLM

    from tests.families import build_family

    path = build_family(family, family_dir)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 60, (n,), generator=g).tolist()} for n in (9, 4, 13)]
    for r in rows:
        r["labels"] = r["input_ids"]
    collator = DataCollatorSFT(0)
    padded, packed = collator(rows), collator.packed()(pack_rows(rows, 40, collator.pack_length))
    assert packed["input_ids"].shape == (1, 26)  # one sequence: best-fit decreasing puts 13, then 9, then 4
    for attention in ("sdpa", "eager") if family != "gemma2" else ("eager",):  # Gemma-2 has no sdpa path
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=torch.float32).eval()
        with torch.no_grad():
            a = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
            b = model(**{k: v for k, v in sft_inputs(model, packed).items() if k != "labels"}).logits[0]
        at = 0
        for i in (2, 0, 1):  # the packed order: 13, 9, 4 tokens
            n = len(rows[i]["input_ids"])
            torch.testing.assert_close(b[at: at + n], a[i, :n], atol=1e-5, rtol=1e-5)
            at += n
