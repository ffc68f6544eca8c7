"""Generative judges (RM-R1; dschat/judge.py): verdict parsing, A/B swapping and balancing, the rubric injection,
metrics, batched generation with votes, the `judge` reward source, and the `eval --judge`, `judge` and
`data balance` commands on the tiny preset."""

from collections import Counter

import pytest

from dschat.config import DataArgs
from dschat.data.phases import cache_key, load_phase
from dschat.data.sources import DataSpec
from dschat.demo.corpus import generate_judge_cold_start, generate_judge_pairs
from dschat.errors import UserError
from dschat.models.loading import load_tokenizer, resolve_model
from dschat.prompts import judge_user_message
from dschat.rewards.functions import judge_match_reward
from dschat.rewards.judge import (
    JudgeReward,
    SamplingArgs,
    balance_rows,
    generate_completions,
    judge_messages,
    judge_metrics,
    majority_verdict,
    parse_verdict,
    question_of,
    swap_answers,
    swap_row,
)
from dschat.utils import write_jsonl
from tests.helpers import read_json, read_jsonl, run_cli

RM_R1_USER = ("[Client Question]\nWhat is 2+2?\n\n[The Start of Chatbot A's Response]\nIt is 4.\n"
              "[The End of Chatbot A's Response]\n\n[The Start of Chatbot B's Response]\nFive, surely.\n"
              "[The End of Chatbot B's Response]")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("tiny"))


# ----------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize("text, verdict", [
    ("<think>x</think>\n<answer>[[A]]</answer>", "A"),
    ("blah <answer>[[B]]</answer>", "B"),
    ("<answer>[[A]]</answer> or <answer>[[B]]</answer>", None),  # both: no verdict
    ("[[A]]", None),  # the tags are part of the verdict
    ("<answer>[[A]]</answer>" + "x" * 80, None),  # outside the last 80 characters
    ("<answer>[[B]]</answer>" + "x" * 58, "B"),  # 22 + 58 = 80 characters: still inside
    ("<answer>[[B]]</answer>" + "x" * 59, None),  # its first character is the 81st from the end
])
def test_parse_verdict_is_the_judge_match_rule(text, verdict):
    assert parse_verdict(text) == verdict
    # judge_match gives +1 exactly when the parsed verdict is the winner's label
    for winner, letter in (("model_a", "A"), ("model_b", "B")):
        assert judge_match_reward([""], [text], winner=[winner]) == [1.0 if verdict == letter else -1.0]


def test_majority_verdict_ties_and_nothing_are_unparseable():
    assert majority_verdict(["A"]) == "A"
    assert majority_verdict(["A", "B", "B", None, None]) == "B"  # None does not vote
    assert majority_verdict(["A", "B"]) is None
    assert majority_verdict([None, None, None]) is None
    assert majority_verdict([]) is None


# ------------------------------------------------------------------------------------ swapping, balancing
def test_swap_answers_both_marker_styles_exchange_only_the_contents():
    demo = judge_user_message("Q?", "good answer", "bad answer", english=True)
    assert swap_answers(demo) == judge_user_message("Q?", "bad answer", "good answer", english=True)
    swapped = swap_answers(RM_R1_USER)
    assert swapped == RM_R1_USER.replace("\nIt is 4.\n", "\n@@\n").replace("\nFive, surely.\n", "\nIt is 4.\n") \
        .replace("\n@@\n", "\nFive, surely.\n")
    assert swap_answers(swapped) == RM_R1_USER  # an involution
    assert swap_answers("no markers here") is None
    assert swap_answers(RM_R1_USER.replace("[The End of Chatbot B's Response]", "")) is None  # unclosed B
    assert swap_answers(RM_R1_USER + "\n[The Start of Chatbot A's Response]") is None  # a marker twice


def _rows(winners):
    return [{"context_messages": [{"role": "system", "content": "rubric"},
                                  {"role": "user", "content": judge_user_message(f"Q{i}", f"a{i}", f"b{i}", True)}],
             "winner": w, "id": i} for i, w in enumerate(winners)]


def test_balance_swaps_exactly_a_and_b_and_flips_the_label():
    rows = _rows(["model_a"] * 6 + ["model_b"])
    out, report = balance_rows(rows, seed=0)
    # 7 rows: the majority (A) keeps ceil(7/2) = 4, so 6 - 4 = 2 of its rows are swapped
    assert report.rows == 7 and report.swapped == 2
    assert report.before == {"model_a": 6, "model_b": 1} and report.after == {"model_a": 4, "model_b": 3}
    assert Counter(r["winner"] for r in out) == {"model_a": 4, "model_b": 3}
    changed = [i for i, (r, o) in enumerate(zip(rows, out, strict=True)) if r != o]
    assert len(changed) == 2
    for i, (r, o) in enumerate(zip(rows, out, strict=True)):
        assert o["id"] == i and o["context_messages"][0] == r["context_messages"][0]  # order and rubric kept
        if i in changed:
            assert r["winner"] == "model_a" and o["winner"] == "model_b"
            assert o["context_messages"][1]["content"] == judge_user_message(f"Q{i}", f"b{i}", f"a{i}", True)
    assert balance_rows(rows, seed=0)[0] == out  # deterministic by seed
    even, rep = balance_rows(_rows(["model_b"] * 4), seed=1)
    assert rep.after == {"model_a": 2, "model_b": 2}
    done, rep = balance_rows(_rows(["model_a", "model_b"]), seed=1)
    assert rep.swapped == 0 and done == _rows(["model_a", "model_b"])


def test_balance_unparseable_rows_error_or_are_skipped():
    rows = _rows(["model_a", "model_a", "model_a"])
    rows[1]["context_messages"][1]["content"] = "no answers in here"
    with pytest.raises(UserError, match=r"f\.jsonl:2: cannot find answers A and B"):
        balance_rows(rows, 0, where=lambda i: f"f.jsonl:{i + 1}")
    out, report = balance_rows(rows, 0, skip_unparseable=True, where=lambda i: f"f.jsonl:{i + 1}")
    assert report.skipped == 1 and report.skipped_where == ["f.jsonl:2"] and len(out) == 2
    assert report.after == {"model_a": 1, "model_b": 1}
    assert swap_row({**_rows(["model_a"])[0], "response": "<answer>[[A]]</answer>"}) is None


def test_data_balance_command(tmp_path):
    src = tmp_path / "judge.jsonl"
    rows = _rows(["model_a"] * 5 + ["model_b"] * 1)
    rows[2]["context_messages"][1]["content"] = "broken"
    write_jsonl(rows, src)
    proc = run_cli("data", "balance", "--data", str(src), "--output", str(tmp_path / "out.jsonl"))
    assert proc.returncode == 2 and f"{src}:3: cannot find answers" in proc.stderr
    proc = run_cli("data", "balance", "--data", str(src), "--output", str(tmp_path / "out.jsonl"), "--seed", "7",
                   "--skip-unparseable")
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1" in proc.stdout and "before: model_a 4, model_b 1" in proc.stdout
    assert "after:  model_a 3, model_b 2" in proc.stdout and "swapped: 1" in proc.stdout
    out = read_jsonl(tmp_path / "out.jsonl")
    assert Counter(r["winner"] for r in out) == {"model_a": 3, "model_b": 2}


# ----------------------------------------------------------------------------------- rubric injection
def test_judge_system_prompt_is_injected_where_missing_and_keyed_in_the_cache(tmp_path, tok):
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Prefer the kinder answer.\n", encoding="utf-8")
    bare = generate_judge_pairs(20, seed=3, with_rubric=False)
    own = generate_judge_pairs(20, seed=4)
    write_jsonl(bare, tmp_path / "bare.jsonl")
    write_jsonl(own, tmp_path / "own.jsonl")
    args = DataArgs(data=[str(tmp_path / "bare.jsonl"), str(tmp_path / "own.jsonl")], data_split="0,0,1",
                    eval_fraction=0.0, max_prompt_seq_len=512, judge_system_prompt=str(rubric),
                    data_cache_dir=str(tmp_path / "cache"))
    rows = load_phase(args, 3, tok, seed=0, log=lambda _: None).train
    texts = [tok.decode(r["prompt_input_ids"], skip_special_tokens=True) for r in rows]
    with_rubric = [t for t in texts if t.startswith("Prefer the kinder answer.")]
    assert len(with_rubric) == 20  # every bare row, and no row that had its own rubric
    for row in rows:  # A/B positions and winners untouched
        assert row["answer"] in ("model_a", "model_b")
    plain = DataArgs(**{**args.__dict__, "judge_system_prompt": ""})
    specs = [DataSpec(d) for d in args.data]
    k1 = cache_key(args, 3, tok, 0, specs)
    assert k1 != cache_key(plain, 3, tok, 0, specs)
    rubric.write_text("Prefer the shorter answer.", encoding="utf-8")
    assert cache_key(args, 3, tok, 0, specs) != k1  # an edited rubric is a new cache
    rubric.write_text("  \n", encoding="utf-8")
    with pytest.raises(UserError, match="rubric.txt: judge system prompt file is empty"):
        load_phase(args, 3, tok, seed=0, log=lambda _: None)
    with pytest.raises(UserError, match="nope.txt: judge system prompt file not found"):
        load_phase(DataArgs(**{**args.__dict__, "judge_system_prompt": str(tmp_path / "nope.txt")}), 3, tok, 0)


def test_cold_start_rows_train_stage_one_and_keep_their_winner(tmp_path, tok):
    rows = generate_judge_cold_start(40, seed=1, verdicts="random")
    assert Counter(r["response"].rsplit("[[", 1)[1][0] for r in rows) == {"A": 20, "B": 20}
    true = generate_judge_cold_start(40, seed=1, verdicts="winner")
    assert all(parse_verdict(r["response"]) == r["winner"][-1].upper() for r in true)
    write_jsonl(rows, tmp_path / "cs.jsonl")
    args = DataArgs(data=[str(tmp_path / "cs.jsonl")], data_split="1,0,0", eval_fraction=0.0, max_seq_len=512,
                    data_cache_dir=str(tmp_path / "cache"))
    sft = load_phase(args, 1, tok, seed=0, log=lambda _: None).train
    assert len(sft) == 40
    answer = tok.decode([t for t in sft[0]["labels"] if t != -100], skip_special_tokens=True)
    assert answer.strip() == rows_by_prompt(rows, tok, sft[0])["response"]


def rows_by_prompt(rows, tok, tokenized):
    """The source row whose user message the tokenized SFT row's prompt holds."""
    n_prompt = sum(1 for t in tokenized["labels"] if t == -100)
    prompt = tok.decode(tokenized["input_ids"][:n_prompt], skip_special_tokens=True)
    [row] = [r for r in rows if r["context_messages"][-1]["content"] in prompt]
    return row


# ---------------------------------------------------------------------------------------------- metrics
def test_judge_metrics_by_hand():
    winners = ["model_a", "model_a", "model_a", "model_b", "model_b"]
    verdicts = ["A", "A", None, "A", "B"]
    m = judge_metrics(verdicts, winners)
    # correct: 1 1 0 0 1 -> 3/5; A rows 2/3, B rows 1/2; bias 2/3 - 1/2 = 1/6; se sqrt(0.6 * 0.4 / 5)
    assert m["n"] == 5 and m["accuracy"] == pytest.approx(0.6) and m["correct"] == [1, 1, 0, 0, 1]
    assert m["accuracy_se"] == pytest.approx((0.6 * 0.4 / 5) ** 0.5)
    assert m["unparseable_rate"] == pytest.approx(0.2)
    assert m["accuracy_when_a"] == pytest.approx(2 / 3) and m["accuracy_when_b"] == pytest.approx(0.5)
    assert m["position_bias"] == pytest.approx(1 / 6)
    assert (m["predicted_a"], m["predicted_b"]) == (3, 1)


# ------------------------------------------------------------------------------------------ reward source
def test_judge_reward_asks_both_orders_and_averages():
    seen = []

    def scripted(verdicts):
        def judge(queries):
            seen.extend(queries)
            return list(verdicts)
        return judge

    prompts = ["\n\nHuman: Where is my parcel?\n\nAssistant:"] * 2
    kw = {"answer": ["It ships today.", "It ships today."], "prompt": prompts}
    # completion 0: judged better as A and as B -> +1; completion 1: better as A, unparseable as B -> 0.5
    assert JudgeReward(scripted(["A", "B", "A", None]))(prompts, ["Sorry! Today.", "meh"], **kw) == [1.0, 0.5]
    # a judge that always says A: +1 as A, -1 as B -> 0 (position bias cancels)
    assert JudgeReward(scripted(["A"] * 4))(prompts, ["x", "y"], **kw) == [0.0, 0.0]
    assert JudgeReward(scripted(["B", "A", None, None]))(prompts, ["x", "y"], **kw) == [-1.0, 0.0]
    first, second = seen[0], seen[1]
    assert first[1]["content"] == judge_user_message("Where is my parcel?", "Sorry! Today.", "It ships today.", True)
    assert second[1]["content"] == judge_user_message("Where is my parcel?", "It ships today.", "Sorry! Today.",
                                                      True)
    with pytest.raises(UserError, match="reference answer"):
        JudgeReward(scripted([]))(prompts, ["x", "y"], answer=[None, "ok"])
    from dschat.rewards.functions import get_reward_func

    with pytest.raises(UserError, match="--judge-model"):  # a model, so only stage 3 can build it
        get_reward_func("judge")


def test_judge_compares_two_models_answers_in_both_orders():
    """``JudgeReward.compare``, which ``dschat eval --step 3`` uses for the judge's win rate of a policy over a
    baseline: an empty answer is an answer (no reference is required), and the orders cancel position bias."""
    seen = []

    def judge(queries):
        seen.extend(queries)
        return ["A", "A", "B", "A"]  # pair 0: always A (bias) -> 0; pair 1: B as A, A as B -> -1

    assert JudgeReward(judge).compare(["Q0", "Q1"], ["p0", ""], ["b0", "b1"]) == [0.0, -1.0]
    assert seen[2][1]["content"] == judge_user_message("Q1", "", "b1", True)  # the policy's answer as A
    assert seen[3][1]["content"] == judge_user_message("Q1", "b1", "", True)  # ... and as B


def test_question_of_prompt_forms():
    assert question_of("\n\nHuman: 你好？\n\nAssistant:", "") == "你好？"
    assert question_of([{"role": "system", "content": "s"}, {"role": "user", "content": "Q1"}], "") == "Q1"
    assert question_of(None, "Human: decoded question Assistant:") == "decoded question"
    assert judge_messages("你好？", "a", "b")[0]["content"].startswith("你是公正的评审")
    assert judge_messages("Hi?", "a", "b", system="R")[0] == {"role": "system", "content": "R"}


# ------------------------------------------------------------------------------------- generation, CLI
def test_batched_left_padded_greedy_equals_one_by_one_and_votes_are_seeded(tok):
    import torch

    from dschat.rewards.judge import encode_prompts, load_judge

    lm, tok, _ = load_judge("tiny", device=torch.device("cpu"))
    prompts = [r["context_messages"] for r in generate_judge_pairs(5, seed=5)]
    ids, cut = encode_prompts(tok, prompts, None)
    assert cut == 0 and len({len(x) for x in ids}) > 1  # different lengths: padding matters
    s = SamplingArgs(max_new_tokens=6, batch_size=5)
    batched = generate_completions(lm, tok, ids, s)
    single = generate_completions(lm, tok, ids, SamplingArgs(max_new_tokens=6, batch_size=1))
    assert batched == single and all(len(c) == 1 for c in batched)
    voted = generate_completions(lm, tok, ids, SamplingArgs(max_new_tokens=6, batch_size=5, votes=3, seed=1))
    assert all(len(c) == 3 for c in voted)
    state = torch.random.get_rng_state()
    assert generate_completions(lm, tok, ids, SamplingArgs(max_new_tokens=6, batch_size=5, votes=3, seed=1)) == voted
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    cut_ids, cut = encode_prompts(tok, prompts, 50)
    assert cut == 5 and all(len(x) == 50 and x[0] == tok.bos_token_id for x in cut_ids)


def test_judge_rows_are_read_as_training_reads_them(tmp_path):
    """A malformed row (a bad winner, a missing field) is dropped and counted, as the training loader does, not a
    reason to stop; a source that is mostly malformed still stops; the rubric is injected as in training."""
    from dschat.rewards.judge import load_judge_rows

    rows = generate_judge_pairs(6, seed=2, with_rubric=False)
    bad = [{**rows[0], "winner": "model_c"}, {"winner": "model_a", "context_messages": "not messages"}]
    write_jsonl(rows + bad, tmp_path / "mixed.jsonl")
    logged: list[str] = []
    got, counts = load_judge_rows([str(tmp_path / "mixed.jsonl")], "Be fair.", log=logged.append)
    assert len(got) == 6 and counts == {"dropped_malformed": 2}
    assert [r.winner for r in got] == [r["winner"] for r in rows]
    assert all(r.messages[0] == {"role": "system", "content": "Be fair."} for r in got)
    assert len(logged) == 2 and "mixed.jsonl:7: field 'winner' must be" in logged[0]
    write_jsonl(rows[:1] + bad, tmp_path / "mostly_bad.jsonl")
    with pytest.raises(UserError, match=r"\(2 of 3 rows of .*mostly_bad\.jsonl are malformed\)"):
        load_judge_rows([str(tmp_path / "mostly_bad.jsonl")])


def test_evaluate_judge_files_in_process(tmp_path):
    from dschat.evaluation.judge import evaluate_judge_files

    write_jsonl(generate_judge_pairs(6, seed=2, with_rubric=False), tmp_path / "held_out.jsonl")
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Be fair.", encoding="utf-8")
    m = evaluate_judge_files("tiny", [str(tmp_path / "held_out.jsonl")], SamplingArgs(max_new_tokens=4, votes=2),
                             str(rubric), progress=False)
    assert m["n"] == 6 and m["votes"] == 2 and (m["rows_winner_a"], m["rows_winner_b"]) == (3, 3)
    # the untrained tiny model writes no verdict in 4 tokens: everything is unparseable, so accuracy is 0
    assert m["unparseable_rate"] == 1.0 and m["accuracy"] == 0.0 and m["format_rate"] == 0.0
    assert len(m["correct"]) == 6 and m["truncated_prompts"] == 0
    write_jsonl([{"prompt": "x", "chosen": "a", "rejected": "b"}], tmp_path / "pairs.jsonl")
    with pytest.raises(UserError, match="needs judge-pairwise rows"):
        evaluate_judge_files("tiny", [str(tmp_path / "pairs.jsonl")], SamplingArgs(), progress=False)
    with pytest.raises(UserError, match="--votes > 1 samples"):
        evaluate_judge_files("tiny", [str(tmp_path / "held_out.jsonl")], SamplingArgs(votes=3, temperature=0))


@pytest.mark.slow
def test_eval_judge_and_judge_commands_on_the_tiny_model(tmp_path):
    write_jsonl(generate_judge_pairs(6, seed=2), tmp_path / "held_out.jsonl")
    proc = run_cli("eval", "--judge", "--model", "tiny", "--data", str(tmp_path / "held_out.jsonl"),
                   "--max-new-tokens", "4", "--votes", "2", "--output", str(tmp_path / "m.json"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "accuracy:" in proc.stdout and "unparseable_rate:" in proc.stdout and "position_bias:" in proc.stdout
    m = read_json(tmp_path / "m.json")
    assert m["n"] == 6 and m["votes"] == 2 and m["rows_winner_a"] == 3
    # the untrained tiny model writes no verdict in 4 tokens: everything is unparseable, so accuracy is 0
    assert m["unparseable_rate"] == 1.0 and m["accuracy"] == 0.0 and m["format_rate"] == 0.0
    write_jsonl([{"prompt": "x", "chosen": "a", "rejected": "b"}], tmp_path / "pairs.jsonl")
    proc = run_cli("eval", "--judge", "--model", "tiny", "--data", str(tmp_path / "pairs.jsonl"))
    assert proc.returncode == 2 and "needs judge-pairwise rows" in proc.stderr

    proc = run_cli("judge", "--model", "tiny", "--question", "Where is my order?", "--answer-a", "Sorry! It ships "
                   "today.", "--answer-b", "Dunno.", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "verdict: unparseable"
    proc = run_cli("judge", "--model", "tiny", "--question", "Q", "--answer-a", "a", "--answer-b", "b",
                   "--system-prompt", str(tmp_path / "missing.txt"))
    assert proc.returncode == 2 and "missing.txt: judge system prompt file not found" in proc.stderr


@pytest.mark.parametrize("flag, value", [("--temperature", "0.5"), ("--top-p", "0.9"), ("--seed", "7")])
def test_judge_refuses_sampling_flags_with_one_vote(flag, value):
    """One vote is greedy: the sampling flags do nothing, so giving one stops with one line."""
    from click.testing import CliRunner

    from dschat.cli.judge import judge_command

    args = ["--model", "tiny", "--question", "Q", "--answer-a", "a", "--answer-b", "b", flag, value]
    result = CliRunner().invoke(judge_command, args)
    assert isinstance(result.exception, UserError), result.output
    assert str(result.exception) == f"{flag} has no effect without --votes > 1 (one vote is greedy)"


def test_judge_s_generation_backend_takes_the_declared_choices():
    from click.testing import CliRunner

    from dschat.cli.judge import judge_command

    result = CliRunner().invoke(judge_command, ["--model", "tiny", "--question", "Q", "--answer-a", "a",
                                                "--answer-b", "b", "--generation-backend", "nope"])
    assert result.exit_code == 2 and "'graph'" in result.output  # the declared choices, graph among them
