"""Tests of the embedded demo and the tiny preset it shapes: generated corpus, the sentencepiece tokenizer (built
by the demo, shipped and loaded by ``dschat.models.tiny``), the tiny model config."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dschat.demo import corpus
from dschat.demo.corpus import (
    generate_judge_pairs,
    generate_pairwise,
    generate_prompts,
    generate_sum_prompts,
    prompt_question,
    write_demo_files,
)
from dschat.demo.tokenizer import SPECIAL_TAGS, build_tokenizer_model, build_tokenizer_model_bytes
from dschat.models.tiny import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TOKENIZER_MODEL_PATH,
    UNK_ID,
    VOCAB_SIZE,
    load_tiny_tokenizer,
    save_tiny_tokenizer,
    tiny_model_config,
)
from dschat.prompts import ASSISTANT_SUFFIX, HUMAN_PREFIX, ZH_RUBRIC

REPO_ROOT = Path(__file__).resolve().parents[2]
CJK = re.compile(r"[\u4e00-\u9fff]")


def is_chinese(text: str) -> bool:
    return CJK.search(text) is not None


@pytest.fixture(scope="module")
def pairwise() -> list[dict[str, str]]:
    return generate_pairwise()


# ---------------------------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------------------------


def test_generators_are_deterministic_and_seeded() -> None:
    assert generate_pairwise(300, seed=0) == generate_pairwise(300, seed=0)
    assert generate_pairwise(300, seed=0) != generate_pairwise(300, seed=1)
    assert generate_prompts(200, seed=0) == generate_prompts(200, seed=0)
    assert generate_prompts(200, seed=0) != generate_prompts(200, seed=1)
    assert generate_judge_pairs(200, seed=0) == generate_judge_pairs(200, seed=0)
    assert generate_judge_pairs(200, seed=0) != generate_judge_pairs(200, seed=1)


def test_generation_ignores_global_random_state() -> None:
    import random

    random.seed(123)
    a = generate_pairwise(50, seed=3)
    random.seed(456)
    assert generate_pairwise(50, seed=3) == a


def test_write_demo_files_byte_identical(tmp_path: Path) -> None:
    a = write_demo_files(tmp_path / "a", seed=0, n_pairwise=400, n_prompts=100, n_judge=100)
    b = write_demo_files(tmp_path / "b", seed=0, n_pairwise=400, n_prompts=100, n_judge=100)
    c = write_demo_files(tmp_path / "c", seed=1, n_pairwise=400, n_prompts=100, n_judge=100)
    assert set(a) == {"pairwise", "prompts", "judge"}
    for key in a:
        assert a[key].name == f"{key}.jsonl"
        assert a[key].read_bytes() == b[key].read_bytes()
        assert a[key].read_bytes() != c[key].read_bytes()
    text = a["pairwise"].read_text(encoding="utf-8")
    assert "\\u" not in text and is_chinese(text)  # ensure_ascii=False
    rows = [json.loads(line) for line in text.splitlines()]
    assert rows == generate_pairwise(400, seed=0)
    assert len(a["prompts"].read_text(encoding="utf-8").splitlines()) == 100


def test_pairwise_size_and_language_mix(pairwise: list[dict[str, str]]) -> None:
    assert len(pairwise) >= 3000
    chinese = sum(is_chinese(r["prompt"]) for r in pairwise)
    english = len(pairwise) - chinese
    assert chinese == round(0.8 * len(pairwise))  # the mix is exact, not drawn row by row
    assert english > 0
    for r in pairwise:  # a row is entirely one language
        assert is_chinese(r["chosen"]) == is_chinese(r["prompt"])


def test_pairwise_format(pairwise: list[dict[str, str]]) -> None:
    for r in pairwise:
        assert set(r) == {"prompt", "response", "chosen", "rejected"}
        assert r["prompt"].startswith(HUMAN_PREFIX) and r["prompt"].endswith(ASSISTANT_SUFFIX)
        assert r["prompt"].count("Human:") == 1 and r["prompt"].count("Assistant:") == 1
        assert prompt_question(r["prompt"]).strip() == prompt_question(r["prompt"]) != ""
        assert r["response"] == r["chosen"]
        for answer in (r["chosen"], r["rejected"]):
            assert answer.startswith(" ") and not answer.startswith("  ") and answer.strip()
        assert r["chosen"] != r["rejected"]
    assert len({r["prompt"] for r in pairwise}) == len(pairwise)  # no question shared across a split


def test_chosen_and_rejected_styles_differ(pairwise: list[dict[str, str]]) -> None:
    openers = corpus._ZH_APOLOGY + corpus._ZH_SERVICE + corpus._EN_APOLOGY + corpus._EN_SERVICE
    for r in pairwise:
        chosen, rejected = r["chosen"].strip(), r["rejected"].strip()
        assert chosen.startswith(openers), chosen  # acknowledges the customer first
        assert not rejected.startswith(openers), rejected
        assert "抱歉" not in rejected and "sorry" not in rejected.lower()
        assert re.search(r"\d", chosen), chosen  # order number, amount, date or time frame
        if is_chinese(chosen):
            assert 20 <= len(chosen) <= 62, chosen
            assert len(rejected) < len(chosen)
        else:
            assert 15 <= len(chosen.split()) <= 45, chosen
        assert len(prompt_question(r["prompt"])) <= 120


def test_pairwise_rows_are_varied(pairwise: list[dict[str, str]]) -> None:
    assert len({r["chosen"] for r in pairwise}) == len(pairwise)
    assert len({r["rejected"] for r in pairwise}) > 200


# Each word problem, re-solved from its own text.
_SOLVERS: list[tuple[re.Pattern[str], object]] = [
    (re.compile(r"我买了(\d+)件.+?，每件(\d+)元，退回(\d+)件"), lambda q, u, r: r * u),
    (re.compile(r"我买了(\d+)件.+?，每件(\d+)元，一共要付多少元"), lambda q, p: q * p),
    (re.compile(r"商品总价(\d+)元，用了一张(\d+)元优惠券"), lambda p, c: p - c),
    (re.compile(r"满(\d+)减(\d+)，我买了(\d+)元的商品"), lambda t, d, p: p - d if p >= t else p),
    (re.compile(r"原价(\d+)元，打(\d+)折"), lambda p, k: p * k // 10),
    (re.compile(r"商品(\d+)元，运费(\d+)元，再用(\d+)元优惠券"), lambda p, s, c: p + s - c),
    (re.compile(r"I bought (\d+) units of the .+? at \$(\d+) each and returned (\d+)"), lambda q, u, r: r * u),
    (re.compile(r"I bought (\d+) units of the .+? at \$(\d+) each\. How many"), lambda q, p: q * p),
    (re.compile(r"My order costs \$(\d+) and I use a \$(\d+) coupon"), lambda p, c: p - c),
    (
        re.compile(r"gives \$(\d+) off orders of \$(\d+) or more\. My cart is \$(\d+)"),
        lambda d, t, p: p - d if p >= t else p,
    ),
    (re.compile(r"costs \$(\d+) and is (\d+)% off"), lambda p, off: p * (100 - off) // 100),
    (re.compile(r"An item costs \$(\d+), shipping is \$(\d+), and I have a \$(\d+) coupon"), lambda p, s, c: p + s - c),
]


def test_prompt_rows_have_consistent_answers() -> None:
    rows = generate_prompts(1000, seed=0, with_solution=True)
    used = [0] * len(_SOLVERS)
    for r in rows:
        assert set(r) == {"prompt", "answer", "solution"}
        assert r["prompt"].startswith(HUMAN_PREFIX) and r["prompt"].endswith(ASSISTANT_SUFFIX)
        for tag in SPECIAL_TAGS:
            assert tag in r["prompt"]  # the prompt asks for the format
        assert re.fullmatch(r"-?\d+", r["answer"])
        matches = [(i, m) for i, (pattern, _) in enumerate(_SOLVERS) if (m := pattern.search(r["prompt"]))]
        assert len(matches) == 1, r["prompt"]
        i, m = matches[0]
        used[i] += 1
        assert int(r["answer"]) == _SOLVERS[i][1](*map(int, m.groups())), r  # type: ignore[operator]
        assert re.fullmatch(rf" <think>[^<]+</think><answer>{r['answer']}</answer>", r["solution"]), r
    assert all(used), used  # every problem kind in both languages
    assert "solution" not in generate_prompts(5)[0]


def test_sum_rows_have_consistent_answers_and_held_out_prompts() -> None:
    rows = generate_sum_prompts(1000, seed=0, with_solution=True)
    assert rows == generate_sum_prompts(1000, seed=0, with_solution=True)
    assert len({r["prompt"] for r in rows}) == 1000 and sum(not is_chinese(r["prompt"]) for r in rows) == 200
    pattern = re.compile(r"(?:I ordered .+ x(\d) and .+ x(\d)\. How many items|我买了(\d)件.+和(\d)件.+，一共几件)")
    pairs = set()
    for r in rows:
        a, b = [int(x) for x in pattern.search(r["prompt"]).groups() if x is not None]
        assert 1 <= a <= 5 and 1 <= b <= 5 and r["answer"] == str(a + b)
        pairs.add((a, b))
        assert r["solution"] == f" <think>{a}+{b}={a + b}</think><answer>{a + b}</answer>"
        assert all(tag in r["prompt"] for tag in SPECIAL_TAGS)
    assert len(pairs) == 25  # every sum of the default range occurs
    wide = generate_sum_prompts(200, seed=3, max_addend=9)
    assert {r["answer"] for r in wide} == {str(n) for n in range(2, 19)}
    # the SFT file of the GRPO demo excludes the GRPO prompts, so its held-out prompts were never trained on
    other = generate_sum_prompts(1000, seed=1, exclude=frozenset(r["prompt"] for r in rows))
    assert not {r["prompt"] for r in other} & {r["prompt"] for r in rows}
    assert "solution" not in other[0]


def test_judge_rows() -> None:
    rows = generate_judge_pairs(401, seed=0)
    openers = corpus._ZH_APOLOGY + corpus._ZH_SERVICE + corpus._EN_APOLOGY + corpus._EN_SERVICE
    assert sum(r["winner"] == "model_a" for r in rows) == 401 // 2
    assert {r["winner"] for r in rows} == {"model_a", "model_b"}
    pattern = re.compile(
        r"\[User Question\]\n(.+)\n\n\[The Start of Assistant A's Answer\]\n(.+)\n\[The End of Assistant A's Answer\]"
        r"\n\n\[The Start of Assistant B's Answer\]\n(.+)\n\[The End of Assistant B's Answer\]\Z",
        re.S,
    )
    for r in rows:
        system, user = r["context_messages"]
        assert system["role"] == "system" and system["content"]
        assert user["role"] == "user"
        assert "[[A]]" in user["content"] and "[[B]]" in user["content"]
        m = pattern.search(user["content"])
        assert m, user["content"]
        _, a, b = m.groups()
        good, bad = (a, b) if r["winner"] == "model_a" else (b, a)
        assert good.startswith(openers) and not bad.startswith(openers)
        assert (system["content"] == ZH_RUBRIC) == is_chinese(user["content"].split("[User Question]")[1])
    bare = generate_judge_pairs(10, seed=0, with_rubric=False)
    assert all([m["role"] for m in r["context_messages"]] == ["user"] for r in bare)
    assert [r["winner"] for r in bare] == [r["winner"] for r in generate_judge_pairs(10, seed=0)]
    assert [r["winner"] for r in generate_judge_pairs(100, seed=0)] != [
        r["winner"] for r in generate_judge_pairs(100, seed=1)
    ]


def test_corpus_import_stays_light() -> None:
    code = (
        "import sys, dschat.demo.corpus, dschat.demo; "
        "print(sorted(m for m in ('torch', 'transformers', 'sentencepiece') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

TRICKY = [
    "您好，非常抱歉！订单12345678的退款将在24小时内到账。",
    "I'm so sorry for the trouble! Order #12345678 ships within 2-3 business days.",
    "\n\nHuman: 我的快递怎么还没到？\n\nAssistant: 抱歉让您久等了！",
    "混合 mixed 文本：English + 中文，（括号）《书名》“引号”…",
    " <think>3*45=135</think><answer>135</answer>",
    "<think>先算总价</think><answer>42</answer>",
    "结论<answer>[[A]]</answer>",
    "  two  spaces and trailing  ",
    "tab\tand\nnewline\n",
    "rare 龘 and emoji 😀",
    "全角ＡＢＣ１２３ and ｈｅｌｌｏ",
    " 非常抱歉",
    "",
]


@pytest.fixture(scope="module")
def sp():  # type: ignore[no-untyped-def]
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(TOKENIZER_MODEL_PATH))


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tiny_tokenizer()


def test_shipped_model_is_small_and_has_expected_ids(sp) -> None:  # type: ignore[no-untyped-def]
    assert TOKENIZER_MODEL_PATH.stat().st_size < 200_000
    assert sp.get_piece_size() == VOCAB_SIZE
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert [sp.piece_to_id(t) for t in SPECIAL_TAGS] == [4, 5, 6, 7]
    assert all(UNK_ID not in sp.encode(t) for t in TRICKY)  # byte fallback, never unk


def test_special_ids(tok, sp) -> None:  # type: ignore[no-untyped-def]
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert len({tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 4
    assert len(tok) == sp.get_piece_size()
    assert tok.convert_tokens_to_ids(list(SPECIAL_TAGS)) == [4, 5, 6, 7]
    batch = tok(["你好", "hello there friend"], padding=True)
    assert batch["input_ids"][0][-1] == PAD_ID and batch["attention_mask"][0][-1] == 0


@pytest.mark.parametrize("text", TRICKY)
def test_hf_ids_equal_sentencepiece_ids(tok, sp, text: str) -> None:  # type: ignore[no-untyped-def]
    assert tok(text)["input_ids"] == [BOS_ID] + sp.encode(text)  # add_bos_token, no eos
    assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text)


def test_hf_ids_equal_sentencepiece_ids_on_demo_data(tok, sp) -> None:  # type: ignore[no-untyped-def]
    texts = [r["prompt"] + a for r in generate_pairwise(1000, seed=7) for a in (r["chosen"], r["rejected"])]
    texts += [r["prompt"] + r["solution"] for r in generate_prompts(300, seed=7, with_solution=True)]
    texts += [m["content"] for r in generate_judge_pairs(100, seed=7) for m in r["context_messages"]]
    assert tok(texts, add_special_tokens=False)["input_ids"] == sp.encode(texts)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip(tok, sp, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert sp.decode(sp.encode(text)) == text


def test_tags_survive_skip_special_tokens(tok) -> None:  # type: ignore[no-untyped-def]
    text = "<think>12*3=36</think><answer>36</answer>"
    ids = tok(text)["input_ids"] + [EOS_ID, PAD_ID, PAD_ID]
    assert tok.decode(ids, skip_special_tokens=True) == text
    for tag in SPECIAL_TAGS:  # one piece each, wherever it appears
        assert tok.convert_ids_to_tokens(tok(f"x{tag}y", add_special_tokens=False)["input_ids"]).count(tag) == 1


def test_save_pretrained_reloads_identically(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path / "a")
    again = AutoTokenizer.from_pretrained(tmp_path / "a")
    again.save_pretrained(tmp_path / "b")  # checkpoints are saved from reloaded tokenizers too
    twice = AutoTokenizer.from_pretrained(tmp_path / "b")
    saved = save_tiny_tokenizer(tmp_path / "c")
    assert (saved / "tokenizer.model").read_bytes() == TOKENIZER_MODEL_PATH.read_bytes()
    for other in (again, twice, load_tiny_tokenizer(saved), AutoTokenizer.from_pretrained(saved)):
        assert other.get_vocab() == tok.get_vocab()
        assert (other.pad_token_id, other.bos_token_id, other.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
        assert other(TRICKY)["input_ids"] == tok(TRICKY)["input_ids"]
        assert other.batch_decode(tok(TRICKY)["input_ids"], skip_special_tokens=True) == TRICKY


def test_rebuild_gives_byte_identical_model(tmp_path: Path) -> None:
    # Fails after a change to the corpus templates: run `python -m dschat.demo tokenizer` and commit the file.
    shipped = TOKENIZER_MODEL_PATH.read_bytes()
    assert build_tokenizer_model_bytes() == shipped
    out = build_tokenizer_model(tmp_path / "sub" / "tokenizer.model")
    assert out.read_bytes() == shipped


# ---------------------------------------------------------------------------------------------------------------
# Tiny model
# ---------------------------------------------------------------------------------------------------------------


def test_tiny_model_config_builds_a_model(tok) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_model_config()
    assert config.vocab_size == len(tok)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert config.tie_word_embeddings is False
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    batch = tok(["您好，非常抱歉！", "Order #12345678 ships today."], padding=True, return_tensors="pt")
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError):
        tiny_model_config(hidden_size=130, num_attention_heads=4)
