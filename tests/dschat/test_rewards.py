"""dschat.rewards.functions: the rule functions on hand-made strings, answer normalisation, user functions, the
mixer."""

import pytest
import torch

from dschat.errors import UserError
from dschat.rewards.functions import (
    RewardMixer,
    accuracy_reward,
    answers_match,
    extract_answer,
    format_reward,
    get_reward_func,
    judge_match_reward,
    load_user_function,
    normalize_answer,
    parse_weights,
)

GOOD = " <think>130*6/10=78</think><answer>78</answer>"


def test_format_needs_one_think_then_one_answer():
    completions = [
        GOOD,  # the demo's worked completion (leading space)
        "<think>a</think>\n<answer>b</answer>\n",  # whitespace between and after is fine
        "<answer>78</answer><think>x</think>",  # wrong order
        "<think>x</think>",  # no answer
        "<answer>78</answer>",  # no think
        "<think>a</think><think>b</think><answer>1</answer>",  # two thinks
        "<think>a</think><answer>1</answer><answer>2</answer>",  # two answers
        "<think>a<answer>1</answer></think>",  # nested
        "<think>a</think> so <answer>1</answer>",  # the rule asks only for the tags, once each and in order:
        "Sure! <think>a</think><answer>1</answer>",  # text before,
        "<think>a</think><answer>1</answer> done",  # between or after the blocks does not matter
    ]
    assert format_reward([""] * len(completions), completions) == [1.0, 1.0] + [0.0] * 6 + [1.0] * 3


@pytest.mark.parametrize("predicted, truth, same", [
    ("78", "78", True),
    (" 78 ", "78", True),
    ("78.0", "78", True),  # trailing .0
    ("78.00", "78", True),
    ("1,234", "1234", True),  # thousands separator
    ("1,234,567.0", "1234567", True),
    ("$1,234", "1234", True),  # currency and separator
    ("78元", "78", True),  # unit
    ("78 dollars", "78", True),
    ("¥78", "78", True),
    ("0.5", ".50", True),  # numeric comparison when both parse
    ("1e3", "1000", True),
    ("-5", "-5.0", True),
    ("79", "78", False),
    ("7.8", "78", False),
    ("1,23", "123", False),  # not a thousands separator: stays text, differs
    ("78 or 79", "78", False),  # two numbers are not one answer
    ("Paris ", "paris", True),  # text: trimmed, case-folded
    ("", "78", False),
    ("", "", False),  # an empty answer never matches
])
def test_answers_match_after_normalisation(predicted, truth, same):
    assert answers_match(predicted, truth) is same


def test_normalize_answer_by_hand():
    assert normalize_answer(" $1,234.50 dollars") == "1234.5"
    assert normalize_answer("100") == "100"  # no "." : trailing zeros of an integer stay
    assert normalize_answer("New  York") == "new york"


def test_accuracy_reads_the_last_answer_block():
    completions = [GOOD, "<think>x</think><answer>77</answer>", "no tags 78", "<answer>1</answer><answer>78</answer>",
                   "<think>x</think><answer> 78.0 </answer>"]
    assert extract_answer(completions[3]) == "78"
    assert accuracy_reward([""] * 5, completions, answer=["78"] * 5) == [1.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(UserError, match="ground truth"):
        accuracy_reward([""], [GOOD], answer=[None])


def test_judge_match_reads_only_the_last_80_characters():
    a, b = "<answer>[[A]]</answer>", "<answer>[[B]]</answer>"
    long_reasoning = "<think>" + "x" * 100 + "</think>"
    completions = [
        long_reasoning + a,  # correct verdict at the end: +1
        long_reasoning + b,  # the other verdict: -1
        "<think>no verdict</think>",  # neither: -1
        f"<think>{a} first thought</think>{b}",  # both labels in the tail: -1
        a + long_reasoning,  # correct verdict, but more than 80 characters before the end: -1
        "y" * 200 + a,  # tail only: +1
    ]
    winners = ["model_a", "model_a", "model_a", "model_a", "model_a", "model_a"]
    assert judge_match_reward([""] * 6, completions, winner=winners) == [1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
    # model_b wins: the B verdict scores, and the winner may come as the row's answer (judge rows)
    assert judge_match_reward(["", ""], [long_reasoning + b, long_reasoning + a],
                              answer=["model_b", "model_b"]) == [1.0, -1.0]
    # the boundary: a verdict that starts exactly 80 characters before the end counts, one more does not
    assert len(a) == 22
    assert judge_match_reward([""], ["z" * 58 + a + ""], winner=["model_a"]) == [1.0]  # 58 + 22 = 80
    assert judge_match_reward([""], [a + "z" * 59], winner=["model_a"]) == [-1.0]  # verdict starts at -81
    with pytest.raises(UserError, match="model_a"):
        judge_match_reward([""], [a], winner=["A"])


def test_overlong_penalty_on_completion_lengths():
    fn = get_reward_func("overlong", max_completion_length=20, overlong_buffer=5, overlong_factor=1.0)
    # 0 up to 15 tokens, then -(len - 15) / 5: 16 -> -0.2, 18 -> -0.6, 20 -> -1.0
    out = fn(["p"] * 4, ["c"] * 4, completion_lengths=[10, 16, 18, 20])
    assert out == pytest.approx([0.0, -0.2, -0.6, -1.0])
    default = get_reward_func("overlong", max_completion_length=20)  # buffer = 20 // 4 = 5
    assert default([""], [""], completion_lengths=[18]) == pytest.approx([-0.6])
    with pytest.raises(UserError, match="overlong-buffer"):
        get_reward_func("overlong", max_completion_length=20, overlong_buffer=30)


def test_user_function_loading_and_errors(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def shorter(prompts, completions, answer=None, **row_fields):\n"
                 "    return [-len(c) / 10 for c in completions]\n"
                 "NOT_A_FUNCTION = 3\n", encoding="utf-8")
    fn = load_user_function(f"{f}:shorter")
    assert fn(["p", "p"], ["ab", "abcd"], answer=["1", "2"]) == [-0.2, -0.4]
    assert get_reward_func(f"{f}:shorter")(["p"], ["a"]) == [-0.1]
    with pytest.raises(UserError, match="not found"):
        load_user_function(f"{tmp_path / 'missing.py'}:shorter")
    with pytest.raises(UserError, match="has no 'longer'.*shorter"):
        load_user_function(f"{f}:longer")
    with pytest.raises(UserError, match="not callable"):
        load_user_function(f"{f}:NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n", encoding="utf-8")
    with pytest.raises(UserError, match="importing .* failed"):
        load_user_function(f"{broken}:f")
    with pytest.raises(UserError, match="unknown reward function 'formatt'"):
        get_reward_func("formatt")


def test_mixer_weights_sum_and_per_function_values():
    completions = [GOOD, "<think>x</think><answer>5</answer>", "78"]
    mixer = RewardMixer(["format", "accuracy", "rm"], [0.5, 2.0, 1.0],
                        funcs={"format": format_reward, "accuracy": accuracy_reward, "rm": None})
    out = mixer(["p"] * 3, completions, external={"rm": torch.tensor([0.1, -0.3, 1.0])}, answer=["78"] * 3)
    # format (1, 1, 0), accuracy (1, 0, 0), rm (0.1, -0.3, 1.0):
    # 0.5*1 + 2*1 + 0.1 = 2.6;  0.5*1 + 0 - 0.3 = 0.2;  0 + 0 + 1.0 = 1.0
    assert out.total.tolist() == pytest.approx([2.6, 0.2, 1.0])
    assert out.per_func["format"].tolist() == [1.0, 1.0, 0.0]
    assert out.per_func["accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert mixer.external == ["rm"]
    # default weights are 1 each
    plain = RewardMixer(["format", "accuracy"])
    assert plain(["p"] * 3, completions, answer=["78"] * 3).total.tolist() == [2.0, 1.0, 0.0]


def test_mixer_rejects_bad_configs_and_outputs(tmp_path):
    with pytest.raises(UserError, match="1 --reward-weights for 2"):
        RewardMixer(["format", "accuracy"], [1.0])
    with pytest.raises(UserError, match="twice"):
        RewardMixer(["format", "format"])
    with pytest.raises(UserError, match="expects numbers"):
        parse_weights(["1", "x"])
    assert parse_weights(["1", "0.5"]) == [1.0, 0.5]
    short = RewardMixer(["bad"], funcs={"bad": lambda prompts, completions, **kw: [1.0]})
    with pytest.raises(UserError, match="returned 1 values for 2"):
        short(["p", "p"], ["a", "b"])
    nan = RewardMixer(["bad"], funcs={"bad": lambda prompts, completions, **kw: [float("nan")] * len(completions)})
    with pytest.raises(UserError, match="non-finite"):
        nan(["p"], ["a"])
