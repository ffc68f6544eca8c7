"""dschat's decode loop (dschat.generation.decode) against transformers' generate, on tiny random models of several
architectures: greedy tokens must be identical (left padding, EOS mid-answer, early stop), the loop's log-probs
must equal a full forward's, and the sampling warpers must cut exactly what HF's cut."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from dschat.generation.decode import DschatBackend, GenerationConfig, HFBackend, HFForward
from dschat.generation.lean_llama import LeanLlama, _BlockProducts
from dschat.generation.sampling import next_token, penalize_repeats, sample, token_logprobs, warp_logits
from dschat.rlhf.rollout import answer_logprobs, make_rollout

PAD = 0
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, pad_token_id=PAD)


def model_of(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    if kind == "llama_gqa_rope3":  # grouped-query attention and llama-3 rope scaling
        cfg = LlamaConfig(**{**SMALL, "num_key_value_heads": 2},
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        return LlamaForCausalLM(cfg).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**{**SMALL, "num_key_value_heads": 2})).eval()
    if kind == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=4, tie_word_embeddings=True)).eval()
    if kind == "gpt2":  # not a Llama layout: the loop runs through the model's own forward
        return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=128)).eval()
    raise KeyError(kind)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 6)):  # left padding of different widths
        ids[row, :pad] = PAD
        mask[row, :pad] = 0
    return ids, mask


def hf_greedy(model, ids, mask, n, eos):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD,
                          eos_token_id=eos)


@pytest.mark.parametrize("kind", ["llama", "llama_gqa_rope3", "mistral", "qwen2", "gpt2"])
def test_greedy_equals_hf_generate(kind):
    model = model_of(kind)
    ids, mask = prompts()
    backend = DschatBackend()
    lean = isinstance(backend.eager(model, 3, 30), LeanLlama)
    assert lean == (kind != "gpt2")
    with torch.no_grad():
        free = hf_greedy(model, ids, mask, 20, eos=1)  # token 1 as EOS: rarely produced
        # make EOS a token that row 0 produces mid-answer, so rows end at different steps and the loop must pad
        # the ended rows and stop when all have ended, as HF does
        eos = int(free[0, ids.shape[1] + 4])
        want = hf_greedy(model, ids, mask, 20, eos=eos)
        got = backend.generate(model, ids, mask, GenerationConfig(max_new_tokens=20, do_sample=False), eos, PAD)
    assert torch.equal(got.sequences, want)
    assert (got.sequences[0, ids.shape[1] + 5:] == PAD).all()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_repeated_prompts_prefill_once(kind, monkeypatch):
    """Rows repeating a prompt (GRPO's groups, here shuffled) run one prefill per distinct prompt, and every row
    continues from its own prompt's cache: greedy tokens equal HF generate's, sampled log-probs a forward pass's."""
    model = model_of(kind)
    base, base_mask = prompts()
    order = torch.tensor([2, 0, 1, 0, 2, 2, 1])
    ids, mask = base[order], base_mask[order]
    widths = []
    forward = LeanLlama.forward
    monkeypatch.setattr(LeanLlama, "forward", lambda self, x, *a: widths.append(x.shape) or forward(self, x, *a))
    with torch.no_grad():
        want = hf_greedy(model, ids, mask, 12, eos=1)
        got = DschatBackend().generate(model, ids, mask, GenerationConfig(max_new_tokens=12, do_sample=False), 1, PAD)
        assert torch.equal(got.sequences, want)
        assert widths[0] == (3, ids.shape[1]) and all(w == (7, 1) for w in widths[1:])
        torch.manual_seed(4)
        cfg = GenerationConfig(max_new_tokens=12, temperature=0.8, logprobs=True)
        out = DschatBackend().generate(model, ids, mask, cfg, 1, PAD)
        rollout, _ = make_rollout(ids, mask, out.sequences, 1, PAD, min_answer_len=0, logprobs=out.logprobs)
        assert torch.allclose(rollout.logprobs, answer_logprobs(model, rollout, temperature=0.8), atol=1e-5)


@pytest.mark.parametrize("kind,split", [("llama", 2), ("llama", 4), ("llama_bias", 2), ("llama_gqa_rope3", 2),
                                        ("mistral", 2), ("qwen2", 4)])
def test_split_step_equals_single_products(kind, split, monkeypatch):
    """The one-token step with its products in S column blocks (``LeanLlama.split``, the CPU default) gives HF
    generate's greedy tokens, and the single-product step's samples and log-probs from the same seed: GQA, q/k/v
    and o biases, a vocabulary (97) padded to a multiple of S, tied embeddings (qwen2)."""
    if kind == "llama_bias":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMALL, attention_bias=True)).eval()
    else:
        model = model_of(kind)
    ids, mask = prompts()
    used = []  # S of every one-token step that ran as column blocks
    head = _BlockProducts.head
    monkeypatch.setattr(_BlockProducts, "head", lambda self, x: used.append(self.S) or head(self, x))

    def run(s, cfg, seed=0):
        monkeypatch.setattr(LeanLlama, "default_split", staticmethod(lambda model: s))
        torch.manual_seed(seed)
        with torch.no_grad():
            return DschatBackend().generate(model, ids, mask, cfg, 1, PAD)

    with torch.no_grad():
        want = hf_greedy(model, ids, mask, 12, eos=1)
    assert torch.equal(run(split, GenerationConfig(max_new_tokens=12, do_sample=False)).sequences, want)
    assert len(used) == 11 and set(used) == {split}
    sampled = GenerationConfig(max_new_tokens=12, temperature=0.8, logprobs=True)
    one = run(1, sampled, seed=3)
    assert len(used) == 11  # S = 1: the single products
    blocks = run(split, sampled, seed=3)
    assert torch.equal(blocks.sequences, one.sequences)
    torch.testing.assert_close(blocks.logprobs, one.logprobs, atol=1e-6, rtol=0)


def test_default_split(monkeypatch):
    """S is the largest divisor of the head counts and widths up to torch's thread count; 1 with one thread, off
    the CPU, or when the copy would pass SPLIT_COPY_BYTES."""
    import dschat.generation.lean_llama as G

    llama, gqa = model_of("llama"), model_of("llama_gqa_rope3")  # heads 4 / kv 4 and 4 / 2; hidden 32, MLP 64
    for threads, want in ((1, (1, 1)), (2, (2, 2)), (3, (2, 2)), (4, (4, 2)), (8, (4, 2))):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        assert (LeanLlama.default_split(llama), LeanLlama.default_split(gqa)) == want, threads
    # llama's attention + MLP + lm_head weights: 2 x (4 x 32 x 32 + 3 x 32 x 64) + 97 x 32 = 23,584 floats
    monkeypatch.setattr(G, "SPLIT_COPY_BYTES", 23_584 * 4)
    assert LeanLlama.default_split(llama) == 4
    monkeypatch.setattr(G, "SPLIT_COPY_BYTES", 23_584 * 4 - 1)
    assert LeanLlama.default_split(llama) == 1


def test_stops_when_every_row_has_ended():
    model = model_of("llama")
    ids, mask = prompts()
    with torch.no_grad():
        free = hf_greedy(model, ids, mask, 6, eos=1)
        # every row's first answer token as EOS: all rows end at step 1
        eos = [int(t) for t in free[:, ids.shape[1]]]
        got = DschatBackend().generate(model, ids, mask, GenerationConfig(max_new_tokens=30, do_sample=False),
                                       eos, PAD)
    assert got.sequences.shape[1] == ids.shape[1] + 1


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_repetition_penalty_equals_hf(kind):
    """Greedy with a repetition penalty gives HF's tokens (prompts without padding: HF also penalises pad ids)."""
    model = model_of(kind)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    cfg = GenerationConfig(max_new_tokens=24, do_sample=False, repetition_penalty=1.8)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                              eos_token_id=1, repetition_penalty=1.8)
        plain = hf_greedy(model, ids, mask, 24, eos=1)
        got = DschatBackend().generate(model, ids, mask, cfg, 1, PAD)
        via_hf = HFBackend().generate(model, ids, mask, cfg, 1, PAD)
    assert torch.equal(got.sequences, want) and torch.equal(via_hf.sequences, want)
    assert not torch.equal(want, plain)  # the penalty changed the answer, so the check above means something


@pytest.mark.parametrize("backend", [DschatBackend(), HFBackend()])
def test_on_token_streams_every_step_and_stops_all_rows(backend):
    """``on_token`` sees each step's tokens, in order, and returning True ends generation after that step."""
    model = model_of("llama")
    ids, mask = prompts()
    seen: list[torch.Tensor] = []

    def on_token(tok: torch.Tensor, policy: torch.Tensor) -> bool:
        seen.append(tok.clone())
        return len(seen) == 3

    with torch.no_grad():
        got = backend.generate(model, ids, mask, GenerationConfig(max_new_tokens=20, do_sample=False), 1, PAD,
                               on_token=on_token)
        full = hf_greedy(model, ids, mask, 20, eos=1)
    assert got.sequences.shape[1] == ids.shape[1] + 3 and len(seen) == 3
    assert torch.equal(torch.stack(seen, 1), got.sequences[:, ids.shape[1]:])
    assert torch.equal(got.sequences, full[:, : ids.shape[1] + 3])
    seen.clear()  # a hook that never stops sees every token, the last one included
    with torch.no_grad():
        got = backend.generate(model, ids, mask, GenerationConfig(max_new_tokens=5, do_sample=False), 1, PAD,
                               on_token=lambda tok, policy: seen.append(tok) and False)
    assert torch.equal(torch.stack(seen, 1), got.sequences[:, ids.shape[1]:]) and len(seen) == 5


def test_loop_logprobs_equal_a_forward_pass():
    """The sampling pass's log-probs are what PPO uses as old log-probs: they must equal answer_logprobs."""
    for kind in ("llama", "gpt2"):
        model = model_of(kind)
        ids, mask = prompts()
        torch.manual_seed(3)
        cfg = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, logprobs=True)
        with torch.no_grad():
            out = DschatBackend().generate(model, ids, mask, cfg, 5, PAD)
            rollout, _ = make_rollout(ids, mask, out.sequences, 5, PAD, min_answer_len=0, logprobs=out.logprobs)
            forward = answer_logprobs(model, rollout, temperature=0.7)
        m = rollout.action_mask.bool()
        assert m.sum() >= 16
        assert torch.allclose(rollout.logprobs[m], forward[m], atol=1e-5), kind
        assert (rollout.logprobs[~m] == 0).all()
        # asked for no log-probs (GRPO with mu = 1, evaluation): none computed, and the same tokens drawn
        torch.manual_seed(3)
        with torch.no_grad():
            plain = DschatBackend().generate(model, ids, mask, replace(cfg, logprobs=False), 5, PAD)
        assert plain.logprobs is None and torch.equal(plain.sequences, out.sequences)


def _answer_logits(model, sequences: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """An eager full forward over prompts and answers: the logits (B, A, V) float32 that predicted each answer
    token (every answer column attended, as HF generate extends the mask)."""
    P = mask.shape[1]
    full = torch.cat([mask, torch.ones(len(mask), sequences.shape[1] - P, dtype=mask.dtype)], dim=1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=sequences, attention_mask=full, position_ids=positions).logits[:, P - 1:-1].float()


def _after_eos(answer: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, A) True strictly after each row's first EOS (the EOS itself is the policy's)."""
    after = torch.zeros_like(answer, dtype=torch.bool)
    for b, row in enumerate(answer.tolist()):
        if eos in row:
            after[b, row.index(eos) + 1:] = True
    return after


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_backend_logprobs_equal_a_forward_pass(kind):
    """``hf`` returns each sampled token's log-prob under the tempered whole vocabulary (top-p cuts what is drawn,
    not what is scored), 0 after a row's EOS: a full forward's, on left-padded rows that end at different steps; an
    ``on_token`` stop returns the log-probs of the steps it ran."""
    assert HFBackend.caps.logprobs
    model = model_of(kind)
    ids, mask = prompts()
    P = ids.shape[1]
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, logprobs=True)
    with torch.no_grad():
        torch.manual_seed(3)
        free = HFBackend().generate(model, ids, mask, cfg, 1, PAD).sequences
        # the token row 0 draws at its 4th step as EOS: the same seed draws the same tokens up to there, so row 0
        # ends by then while the others go on
        eos = int(free[0, P + 3])
        torch.manual_seed(3)
        out = HFBackend().generate(model, ids, mask, cfg, eos, PAD)
        logits = _answer_logits(model, out.sequences, mask)
    answer = out.sequences[:, P:]
    A = answer.shape[1]
    after = _after_eos(answer, eos)
    ends = [row.index(eos) if eos in row else A for row in answer.tolist()]
    assert ends[0] <= 3 and len(set(ends)) > 1 and after.any()  # what was arranged: rows end at different steps
    assert (answer[after] == PAD).all()
    want = (logits / 0.7).log_softmax(-1).gather(-1, answer[..., None]).squeeze(-1).masked_fill(after, 0.0)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32 and out.logprobs.shape == (3, A)
    torch.testing.assert_close(out.logprobs, want, atol=1e-5, rtol=0)
    assert (out.logprobs[~after] < 0).all()
    steps: list[torch.Tensor] = []
    with torch.no_grad():
        torch.manual_seed(3)
        short = HFBackend().generate(model, ids, mask, cfg, eos, PAD,
                                     on_token=lambda tok, policy: steps.append(tok) or len(steps) == 3)
    assert short.sequences.shape[1] == P + 3 and short.logprobs is not None and short.logprobs.shape == (3, 3)
    torch.testing.assert_close(short.logprobs, out.logprobs[:, :3], atol=1e-6, rtol=0)


def _penalized_by_hand(logits: torch.Tensor, row: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """A step's logits (V,) under HF's repetition penalty (1.3) as its generate applies it: over the tokens of its
    ``input_ids`` so far, ``row[:end]``, from the row's first attended prompt token ``first`` on."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[row[first:end]] = True
    return penalize_repeats(logits[None], seen[None], 1.3)[0]


@pytest.mark.parametrize("do_sample", [True, False])
def test_hf_backend_logprobs_under_hf_repetition_penalty(do_sample):
    """With a repetition penalty the log-probs are of the distribution HF drew from: the penalty over every token
    HF's ``input_ids`` held at that step but the left padding (checked against HF's own processed scores), then the
    temperature, over the whole vocabulary; greedy rows too (of the tempered distribution, as dschat's loop)."""
    model = model_of("llama")
    ids, mask = prompts()
    P = ids.shape[1]
    first = [int(m.nonzero()[0]) for m in mask]
    assert first == [0, 3, 6]
    with torch.no_grad():  # the hand rule is HF's: greedy scores are the raw logits after the penalty alone
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                            eos_token_id=1, repetition_penalty=1.3, temperature=1.0, top_p=1.0, top_k=0,
                            output_scores=True, output_logits=True, return_dict_in_generate=True)
    for t, (raw, scores) in enumerate(zip(hf.logits, hf.scores, strict=True)):
        for b in range(3):
            want = _penalized_by_hand(raw[b], hf.sequences[b], first[b], P + t)
            torch.testing.assert_close(scores[b], want, atol=1e-6, rtol=0)
    # the padded rows' first step: PAD (never a prompt token here) is in their input_ids but not penalised
    assert torch.equal(hf.scores[0][1:, PAD], hf.logits[0][1:, PAD]) and (hf.logits[0][1:, PAD] != 0).all()

    cfg = GenerationConfig(max_new_tokens=16, do_sample=do_sample, temperature=0.7, top_p=0.9,
                           repetition_penalty=1.3, logprobs=True)
    with torch.no_grad():
        torch.manual_seed(5)
        out = HFBackend().generate(model, ids, mask, cfg, 1, PAD)
        logits = _answer_logits(model, out.sequences, mask)
    seq = out.sequences
    answer = seq[:, P:]
    want = torch.zeros(answer.shape)
    for b in range(3):
        for t in range(answer.shape[1]):
            penalized = _penalized_by_hand(logits[b, t], seq[b], first[b], P + t)
            want[b, t] = (penalized / 0.7).log_softmax(-1)[answer[b, t]]
    want = want.masked_fill(_after_eos(answer, 1), 0.0)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, want, atol=1e-5, rtol=0)
    unpenalized = (logits / 0.7).log_softmax(-1).gather(-1, answer[..., None]).squeeze(-1)
    assert (out.logprobs - unpenalized).abs().max() > 1e-2  # the penalty moved them, so the check above means something


def test_hf_backend_without_logprobs_samples_as_generate(monkeypatch):
    """Log-probs not asked for: ``model.generate`` is called as before (no output flags) and draws what it draws
    when called directly with the same seed; asked for, the flags change nothing drawn."""
    model = model_of("llama")
    ids, mask = prompts()
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.7, top_p=0.9, repetition_penalty=1.3)
    with torch.no_grad():
        torch.manual_seed(7)
        want = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.7,
                              top_p=0.9, top_k=0, repetition_penalty=1.3, pad_token_id=PAD, eos_token_id=1,
                              use_cache=True)
        calls: list[dict] = []
        generate = model.generate
        monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(k) or generate(*a, **k))
        torch.manual_seed(7)
        plain = HFBackend().generate(model, ids, mask, cfg, 1, PAD)
        torch.manual_seed(7)
        scored = HFBackend().generate(model, ids, mask, replace(cfg, logprobs=True), 1, PAD)
    assert plain.logprobs is None and torch.equal(plain.sequences, want)
    assert "output_logits" not in calls[0] and "return_dict_in_generate" not in calls[0]
    assert scored.logprobs is not None and torch.equal(scored.sequences, want)


def test_wrapped_layers_take_the_forward_path():
    model = model_of("llama")
    model.model.layers[0].self_attn.q_proj = torch.nn.Sequential(model.model.layers[0].self_attn.q_proj)
    ok, why = LeanLlama.supported(model, 30)
    assert not ok and "wrapped" in why
    assert isinstance(DschatBackend().eager(model, 3, 30), HFForward)


def test_warpers_hand_worked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # top-k 2 keeps the two largest
    out = warp_logits(logits, GenerationConfig(top_k=2))
    assert torch.isinf(out[0, 2:]).all() and torch.equal(out[0, :2], logits[0, :2])
    # probabilities: softmax([2,1,0,-1]) = [0.6439, 0.2369, 0.0871, 0.0321]; top-p 0.8 keeps {0, 1} (0.881 >= 0.8),
    # top-p 0.6 keeps only token 0 (0.644 >= 0.6)
    assert torch.isinf(warp_logits(logits, GenerationConfig(top_p=0.8))[0]).tolist() == [False, False, True, True]
    assert torch.isinf(warp_logits(logits, GenerationConfig(top_p=0.6))[0]).tolist() == [False, True, True, True]
    # temperature 2 halves the logits
    assert torch.allclose(warp_logits(logits, GenerationConfig(temperature=2.0)), logits / 2)
    # sampling never picks a cut token
    torch.manual_seed(0)
    picks = {int(next_token(logits.repeat(200, 1), GenerationConfig(top_k=2)).max())}
    assert picks <= {0, 1}
    # log-prob of token 1 at temperature 1: 1 - logsumexp([2,1,0,-1]) = 1 - 2.4402 = -1.4402
    assert token_logprobs(logits, torch.tensor([1]), 1.0).item() == pytest.approx(-1.44019, abs=1e-4)


def test_sample_hand_worked(monkeypatch):
    """Inverse-CDF draws: the uniform's place in the running sum picks the token; zero-probability (filtered) tokens
    are never drawn, not even at the ends of [0, 1); frequencies follow the probabilities."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])  # running sum 0, .25, .25, .75, 1, 1
    for u, want in ((0.0, 1), (0.2499, 1), (0.25, 3), (0.7499, 3), (0.75, 4), (1 - 2**-53, 4), (1.0, 4)):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(*a, u, dtype=k["dtype"]))
        assert sample(probs).tolist() == [want], u
    monkeypatch.undo()
    # unnormalised rows too (the total scales the uniform), and each row its own draw
    torch.manual_seed(0)
    draws = sample(torch.tensor([[1.0, 0.0, 3.0, 4.0], [0.0, 0.0, 0.0, 2.0]]).repeat(40000, 1))
    a, b = draws.view(40000, 2).unbind(1)
    freq = torch.bincount(a, minlength=4).double() / 40000
    assert freq[1] == 0 and torch.allclose(freq, torch.tensor([0.125, 0.0, 0.375, 0.5], dtype=torch.float64),
                                           atol=0.01)  # 4 standard errors at 40,000 draws
    assert (b == 3).all()


def test_warpers_match_hf():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    cfg = GenerationConfig(temperature=0.7, top_k=10, top_p=0.8)
    want = TopPLogitsWarper(0.8)(None, TopKLogitsWarper(10)(None, TemperatureLogitsWarper(0.7)(None, logits)))
    assert torch.equal(torch.isinf(warp_logits(logits, cfg)), torch.isinf(want))


@pytest.mark.slow  # compiles the decode step, which is slow on a CPU
def test_compiled_backend_matches_the_eager_loop():
    """--generation-backend compiled: greedy tokens equal to the eager lean loop's (left padding, EOS mid-answer),
    sampled tokens and their log-probs from the same seed equal to float rounding; a model the lean step cannot run
    is refused with one line."""
    from dschat.errors import UserError
    from dschat.generation.backends import make_backend

    model = model_of("llama_gqa_rope3")
    ids, mask = prompts()
    eager, compiled = DschatBackend(), make_backend("compiled")
    with torch.no_grad():
        free = eager.generate(model, ids, mask, GenerationConfig(max_new_tokens=20, do_sample=False), 1, PAD)
        eos = int(free.sequences[0, ids.shape[1] + 4])
        greedy = GenerationConfig(max_new_tokens=20, do_sample=False)
        want = eager.generate(model, ids, mask, greedy, eos, PAD).sequences
        assert torch.equal(compiled.generate(model, ids, mask, greedy, eos, PAD).sequences, want)
        sample = GenerationConfig(max_new_tokens=20, temperature=0.9, logprobs=True)
        torch.manual_seed(5)
        a = eager.generate(model, ids, mask, sample, 1, PAD)
        torch.manual_seed(5)
        b = compiled.generate(model, ids, mask, sample, 1, PAD)
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    with torch.no_grad():  # an optimizer step between generations: the compiled step reads the new weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        after = eager.generate(model, ids, mask, greedy, eos, PAD).sequences
        assert not torch.equal(after, want)
        assert torch.equal(compiled.generate(model, ids, mask, greedy, eos, PAD).sequences, after)
    with pytest.raises(UserError, match="--generation-backend compiled needs a Llama-architecture model"):
        compiled.generate(model_of("gpt2"), ids, mask, greedy, eos, PAD)


def test_compiled_backend_with_lora_refused_before_loading():
    from dschat.config import build_config
    from dschat.errors import UserError
    from dschat.rlhf.config import RLHFConfig, check_config

    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "generation_backend": "compiled",
                                    "actor_lora_dim": 8})
    with pytest.raises(UserError, match="--generation-backend compiled runs the actor's plain weights"):
        check_config(cfg)
    check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "generation_backend": "compiled"}))


def test_compiled_backend_refuses_other_architectures_before_loading(tmp_path):
    from dschat.config import build_config
    from dschat.errors import UserError
    from dschat.rlhf.config import RLHFConfig, check_config

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    cfg = build_config(RLHFConfig, {"algo": "grpo", "actor_model": str(tmp_path), "generation_backend": "compiled"})
    with pytest.raises(UserError, match=f"compiled needs a Llama-architecture model .*; {tmp_path} is gpt2"):
        check_config(cfg)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    check_config(cfg)
    check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": str(tmp_path / "absent"),
                                           "generation_backend": "compiled"}))  # the loader reports that one
