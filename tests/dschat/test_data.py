"""Data core: formats, splits, phases, collators, the tokenized cache, and user errors (docs/data.md)."""

import json
import os
import re
import time

import pytest

from dschat.config import DataArgs
from dschat.data import DataCollatorReward, DataCollatorRLHF, DataCollatorSFT, load_phase
from dschat.data.formats import (
    CONV_PAIRWISE,
    JUDGE,
    PAIRWISE,
    PROMPT_ONLY,
    SFT,
    detect_format,
    parse_row,
)
from dschat.data.phases import split_indices
from dschat.data.sources import WHERE, DataSpec, load_source
from dschat.errors import UserError
from dschat.models.loading import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("tiny"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def pairwise_rows(n):
    return [{"prompt": f"\n\nHuman: 我的订单{i}什么时候到？\n\nAssistant:", "chosen": f" 您好，订单{i}预计明天送达。",
             "rejected": " 不知道。"} for i in range(n)]


def args(paths, **kw):
    kw.setdefault("data_split", "10,0,0")
    kw.setdefault("data_cache_dir", "")
    return DataArgs(data=list(paths), **kw)


# ------------------------------------------------------------------------------------------------- splitting
def test_split_is_disjoint_covering_and_deterministic():
    parts = [split_indices(101, [2, 4, 4], seed=7, phase=k) for k in (1, 2, 3)]
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(101))  # disjoint and covering
    # bounds: round(101*0.2)=20, round(101*0.6)=round(60.6)=61, 101 -> parts of 20, 41, 40
    assert [len(p) for p in parts] == [20, 41, 40]
    assert parts[0] == split_indices(101, [2, 4, 4], seed=7, phase=1)
    assert parts[0] != split_indices(101, [2, 4, 4], seed=8, phase=1)


def test_split_all_to_phase_one():
    assert sorted(split_indices(10, [10, 0, 0], 0, 1)) == list(range(10))
    assert split_indices(10, [10, 0, 0], 0, 2) == []


def test_data_spec_weight():
    assert DataSpec.parse("a.jsonl:0.5") == DataSpec("a.jsonl", 0.5)
    assert DataSpec.parse("Dahoas/rm-static") == DataSpec("Dahoas/rm-static", 1.0)
    assert DataSpec.parse("Dahoas/rm-static:2") == DataSpec("Dahoas/rm-static", 2.0)


# --------------------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("row,fmt", [
    ({"prompt": "p", "chosen": "c", "rejected": "r"}, PAIRWISE),
    ({"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: hi\n\nAssistant: b"}, PAIRWISE),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}, CONV_PAIRWISE),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, CONV_PAIRWISE),
    ({"prompt": "p", "response": "r"}, SFT),
    ({"prompt": "p", "completion": "r"}, SFT),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, SFT),
    ({"INSTRUCTION": "q", "RESPONSE": "a"}, SFT),
    ({"prompt": "p", "answer": "42"}, PROMPT_ONLY),
    ({"context_messages": [{"role": "user", "content": "q"}], "winner": "model_a"}, JUDGE),
])
def test_detect_format(row, fmt):
    assert detect_format(row) == fmt


def test_hh_rlhf_rows_split_at_last_assistant_turn():
    ex = parse_row({"chosen": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: again\n\nAssistant: good",
                    "rejected": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: again\n\nAssistant: bad"}, PAIRWISE)
    assert ex.prompt == "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: again\n\nAssistant:"
    assert (ex.chosen, ex.rejected) == (" good", " bad")


def test_conversational_pairwise_shared_prefix():
    q = [{"role": "user", "content": "物流到哪了"}]
    ex = parse_row({"chosen": q + [{"role": "assistant", "content": "已发货"}],
                    "rejected": q + [{"role": "assistant", "content": "不知道"}]}, CONV_PAIRWISE)
    assert ex.prompt == q and ex.chosen == "已发货" and ex.rejected == "不知道"


def test_a_malformed_row_is_dropped_counted_and_named_by_file_line_and_field(tmp_path, tok):
    rows = pairwise_rows(20)
    del rows[2]["rejected"]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    lines: list[str] = []
    pd = load_phase(args([path], data_split="10,0,0", eval_fraction=0.0), 1, tok, seed=0, use_cache=False,
                    log=lines.append)
    assert pd.counts["dropped_malformed"] == 1 and pd.counts["train_rows"] == 19
    assert any(re.search(r"dropped a malformed row: .*bad\.jsonl:3: missing field 'rejected'", x) for x in lines)


def test_a_mostly_malformed_file_stops_with_file_line_and_field(tmp_path, tok):
    rows = [{"context_messages": [{"role": "user", "content": f"问题{i}"}], "winner": "A"} for i in range(6)]
    path = write_jsonl(tmp_path / "typo.jsonl", rows)
    with pytest.raises(UserError, match=r"typo\.jsonl:\d+: field 'winner' must be .*\(6 of 6 rows .* malformed\)"):
        load_phase(args([path], data_split="0,0,10"), 3, tok, seed=0, use_cache=False, log=lambda _: None)


def test_malformed_json_names_line(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a", "response": \n', encoding="utf-8")
    with pytest.raises(UserError, match=r"broken\.jsonl:2: malformed JSON"):
        load_phase(args([str(path)]), 1, tok, seed=0, use_cache=False, log=lambda _: None)


def test_missing_file_and_unknown_dataset(tok):
    with pytest.raises(UserError, match="nope.jsonl: file not found"):
        load_phase(args(["nope.jsonl"]), 1, tok, seed=0, log=lambda _: None)
    with pytest.raises(UserError, match="could not be loaded from the HF cache"):
        load_phase(args(["no-such-owner/no-such-set"]), 1, tok, seed=0, log=lambda _: None)


def test_phase_without_rows_is_a_clear_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", pairwise_rows(10))
    with pytest.raises(UserError, match="gives train phase 2 no rows"):
        load_phase(args([path], data_split="10,0,0"), 2, tok, seed=0, log=lambda _: None)


def test_empty_after_filtering_is_a_clear_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}] * 5)
    with pytest.raises(UserError, match="no usable rows.*dropped_no_response=5"):
        load_phase(args([path], eval_fraction=0.0), 1, tok, seed=0, use_cache=False, log=lambda _: None)


# ---------------------------------------------------------------------------------------------------- phases
def test_phase1_masks_prompt_and_ends_with_eos(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", pairwise_rows(20))
    pd = load_phase(args([path], eval_fraction=0.1), 1, tok, seed=0, use_cache=False, log=lambda _: None)
    assert pd.counts["train_rows"] == 18 and pd.counts["eval_rows"] == 2
    row = pd.train[0]
    n_prompt = sum(1 for x in row["labels"] if x == -100)
    i = re.search(r"订单(\d+)", tok.decode(row["input_ids"])).group(1)
    prompt_ids = tok(f"\n\nHuman: 我的订单{i}什么时候到？\n\nAssistant:")["input_ids"]
    assert row["input_ids"][:n_prompt] == prompt_ids
    assert row["input_ids"][-1] == tok.eos_token_id and row["labels"][-1] == tok.eos_token_id
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert "预计明天送达" in tok.decode(row["input_ids"][n_prompt:])
    unmasked = load_phase(args([path], eval_fraction=0.1, mask_prompt=False), 1, tok, seed=0, use_cache=False,
                          log=lambda _: None)
    assert all(x != -100 for x in unmasked.train[0]["labels"])


# ------------------------------------------------------------------------------------------ multi-turn SFT
CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Refund?"}, {"role": "assistant", "content": "Yes"},
                {"role": "user", "content": "When?"}, {"role": "assistant", "content": "Today"}]
M = -100


def _phase1_row(tmp_path, tok, row, **kw):
    path = write_jsonl(tmp_path / "conv.jsonl", [row])
    pd = load_phase(args([path], eval_fraction=0.0, **kw), 1, tok, seed=0, use_cache=False, log=lambda _: None)
    return pd.train[0], pd.counts


def test_a_messages_row_trains_every_assistant_turn_without_a_chat_template(tmp_path, tok):
    row, counts = _phase1_row(tmp_path, tok, {"messages": CONVERSATION})
    human = [277, 278, 3218]  # '▁\n\n' 'Human' ':'
    assistant = [272, 3218]  # 'Assistant' ':' (after a piece ending in '\n\n')
    hi = [1, *human, 1017, 265, *assistant]  # '<s>' ... '▁Hi' '\n\n' ...: the first span gets the BOS
    hello = [3205, 952]  # '▁' '▁Hello': " Hello", the answer's own leading space after the dummy prefix
    refund = [*human, 740, 561, 480, *assistant]  # '▁Re' 'fund' '?\n\n'
    yes = [3205, 692, 961]  # '▁' '▁Y' 'es'
    when = [*human, 699, 3139, 480, *assistant]  # '▁W' 'hen' '?\n\n'
    today = [3205, 588, 3214, 2023]  # '▁' '▁T' 'o' 'day'
    eos = 2
    assert row["input_ids"] == hi + hello + refund + yes + when + today + [eos]
    assert row["labels"] == ([M] * 8 + hello + [M] * 8 + yes + [M] * 8 + today + [eos])
    assert "multi_turn_last_only" not in counts
    # the same conversation as a prompt (messages) + response row: the earlier turns are context, as before
    row, _ = _phase1_row(tmp_path, tok, {"prompt": CONVERSATION[:-1], "response": "Today"})
    assert row["labels"] == [M] * (len(row["input_ids"]) - 5) + today + [eos]
    assert "Hello" in tok.decode(row["input_ids"][:-5]) and "Yes" in tok.decode(row["input_ids"][:-5])


def test_a_messages_row_trains_every_assistant_turn_through_the_chat_template(tmp_path):
    from tests.families import build_family

    qwen = load_tokenizer(str(build_family("qwen2", tmp_path / "fam")))  # ChatML; no BOS; eos <|endoftext|>

    def ids(text):
        return qwen(text, add_special_tokens=False)["input_ids"]

    row, _ = _phase1_row(tmp_path, qwen, {"messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION]})
    # Each assistant turn is trained through its end-of-turn marker; system, user and headers are masked.
    spans = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
              False), ("Hello<|im_end|>\n", True),
             ("<|im_start|>user\nRefund?<|im_end|>\n<|im_start|>assistant\n", False), ("Yes<|im_end|>\n", True),
             ("<|im_start|>user\nWhen?<|im_end|>\n<|im_start|>assistant\n", False), ("Today<|im_end|>\n", True)]
    want_ids = [t for text, _ in spans for t in ids(text)] + [qwen.eos_token_id]
    want_labels = [t if trained else M for text, trained in spans for t in ids(text)] + [qwen.eos_token_id]
    assert row["input_ids"] == want_ids
    assert row["labels"] == want_labels
    assert sum(t != M for t in want_labels) == sum(len(ids(text)) for text, trained in spans if trained) + 1


def test_a_template_that_rewrites_earlier_turns_trains_the_last_answer_only(tmp_path):
    tiny = load_tokenizer(resolve_model("tiny"))
    # Like Qwen3's template (which drops the reasoning of earlier turns): earlier answers are written shortened,
    # so a conversation is not the prefix of its continuation and the earlier turns cannot be cut out.
    tiny.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[A] ...\n"
                          "{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    row, counts = _phase1_row(tmp_path, tiny, {"messages": CONVERSATION})
    assert counts["multi_turn_last_only"] == 1
    trained = [t for t in row["labels"] if t != M]
    n = len(trained)
    assert trained == row["input_ids"][-n:] and tiny.decode(trained, skip_special_tokens=True).strip() == "Today"


def test_one_turn_rows_tokenize_as_before_multi_turn_sft(tmp_path, tok):
    """The ids of a one-turn messages row, written down before multi-turn SFT existed."""
    row, _ = _phase1_row(tmp_path, tok, {"messages": CONVERSATION[:2]})
    assert row["input_ids"] == [1, 277, 278, 3218, 1017, 265, 272, 3218, 3205, 952, 2]
    assert row["labels"] == [M] * 8 + [3205, 952, 2]


def test_phase2_drops_identical_and_too_long(tmp_path, tok):
    rows = pairwise_rows(10)
    rows[0]["rejected"] = rows[0]["chosen"]  # identical pair
    rows[1]["chosen"] = " 好" * 400  # too long
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    lines: list[str] = []
    pd = load_phase(args([path], data_split="0,1,0", eval_fraction=0.0), 2, tok, seed=0, use_cache=False,
                    log=lines.append)
    assert pd.counts["dropped_identical_pair"] == 1
    assert pd.counts["dropped_too_long"] == 1
    assert pd.counts["train_rows"] == 8
    # the counts are printed, not only written to eval.json
    assert "data: phase 2: 8 train rows, 0 eval rows; dropped: identical_pair 1, too_long 1" in lines
    row = pd.train[0]
    assert row["chosen_input_ids"] != row["rejected_input_ids"]
    assert row["chosen_input_ids"][-1] == tok.eos_token_id == row["rejected_input_ids"][-1]


def test_phase3_left_truncates_long_prompts(tmp_path, tok):
    rows = [{"prompt": "很长的问题" * 80 + "\n\nAssistant:", "answer": "7"}, {"prompt": "短问题\n\nAssistant:"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    pd = load_phase(args([path], data_split="0,0,1", eval_fraction=0.0, max_prompt_seq_len=32), 3, tok, seed=0,
                    use_cache=False, log=lambda _: None)
    assert pd.counts["truncated_prompt"] == 1
    long = next(r for r in pd.train if r["answer"] == "7")
    assert len(long["prompt_input_ids"]) == 32
    assert tok.decode(long["prompt_input_ids"]).rstrip().endswith("Assistant:")  # the end is kept


def test_weights_scale_rows(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", pairwise_rows(10))
    pd = load_phase(args([a + ":2"], eval_fraction=0.0), 1, tok, seed=0, use_cache=False, log=lambda _: None)
    assert pd.counts["train_rows"] == 20
    pd = load_phase(args([a + ":0.5"], eval_fraction=0.0), 1, tok, seed=0, use_cache=False, log=lambda _: None)
    assert pd.counts["train_rows"] == 5


def test_cache_hit_and_invalidation_on_change(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    write_jsonl(path, pairwise_rows(10))
    cfg = args([str(path)], data_cache_dir=str(tmp_path / "cache"), eval_fraction=0.0)
    msgs = []
    first = load_phase(cfg, 1, tok, seed=0, log=msgs.append)
    second = load_phase(cfg, 1, tok, seed=0, log=msgs.append)
    assert any("from cache" in m for m in msgs) and second.train == first.train
    time.sleep(0.01)
    write_jsonl(path, pairwise_rows(12))  # changed content (size and mtime)
    msgs.clear()
    third = load_phase(cfg, 1, tok, seed=0, log=msgs.append)
    assert not any("from cache" in m for m in msgs)
    assert third.counts["train_rows"] == 12
    # the key is the content, not the mtime: a touched file is still served from the cache (an edit that keeps
    # size and mtime is not: tests/reliability/test_inputs.py)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    msgs.clear()
    load_phase(cfg, 1, tok, seed=0, log=msgs.append)
    assert any("from cache" in m for m in msgs)


def test_every_format_loads_for_phase1(tmp_path, tok):
    q = [{"role": "user", "content": "发票怎么开？"}]
    files = {
        "pairwise.jsonl": [{"prompt": "\n\nHuman: 退款多久到账？\n\nAssistant:", "chosen": " 一般三个工作日。",
                            "rejected": " 不清楚。"}],
        "conv.jsonl": [{"chosen": q + [{"role": "assistant", "content": "在订单页申请电子发票。"}],
                        "rejected": q + [{"role": "assistant", "content": "自己看。"}]}],
        "sft.json": [{"prompt": "Where is my parcel?", "completion": " It ships today."}],
        "msgs.jsonl": [{"messages": q + [{"role": "assistant", "content": "可以开具。"}]}],
    }
    for name, rows in files.items():
        p = tmp_path / name
        if name.endswith(".json"):
            p.write_text(json.dumps(rows * 4, ensure_ascii=False), encoding="utf-8")
        else:
            write_jsonl(p, rows * 4)
        pd = load_phase(args([str(p)], eval_fraction=0.0), 1, tok, seed=0, use_cache=False, log=lambda _: None)
        assert pd.counts["train_rows"] == 4, name


def test_parquet_and_save_to_disk(tmp_path, tok):
    import datasets

    ds = datasets.Dataset.from_list(pairwise_rows(8))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    pd = load_phase(args([str(tmp_path / "d.parquet")], eval_fraction=0.0), 1, tok, seed=0, use_cache=False,
                    log=lambda _: None)
    assert pd.counts["train_rows"] == 8
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(pairwise_rows(3))}).save_to_disk(
        str(tmp_path / "saved"))
    pd = load_phase(args([str(tmp_path / "saved")]), 1, tok, seed=0, use_cache=False, log=lambda _: None)
    assert pd.counts["train_rows"] == 8 and pd.counts["eval_rows"] == 3  # the dataset's own test split


# ------------------------------------------------------------------------------------------------ collators
def test_collators_pad_dynamically_on_the_right_side():
    sft = DataCollatorSFT(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
                                           {"input_ids": [5], "labels": [5]}])
    assert sft["input_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert sft["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert sft["labels"].tolist() == [[-100, 6, 7], [5, -100, -100]]

    rm = DataCollatorReward(pad_token_id=2)([
        {"chosen_input_ids": [1, 4, 2], "rejected_input_ids": [1, 5]},
        {"chosen_input_ids": [1, 6], "rejected_input_ids": [1, 7, 8, 2]},
    ])
    # B chosen first, then B rejected; pad id equals EOS (2) here, the mask tells them apart
    assert rm["input_ids"].tolist() == [[1, 4, 2, 2], [1, 6, 2, 2], [1, 5, 2, 2], [1, 7, 8, 2]]
    assert rm["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]

    rl = DataCollatorRLHF(pad_token_id=0)([{"prompt_input_ids": [1, 2, 3], "answer": "7"},
                                           {"prompt_input_ids": [1, 9]}])
    assert rl["prompt"].tolist() == [[1, 2, 3], [0, 1, 9]]  # left padded: generation starts aligned
    assert rl["prompt_att_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert rl["answer"] == ["7", None]


def test_every_row_format_has_its_parser():
    """``parse_row`` dispatches through ``PARSERS``: one parser per detected format, none without a format."""
    from dschat.data.formats import FORMATS, PARSERS

    assert set(PARSERS) == set(FORMATS)


# ------------------------------------------------------------------------------------------ tool-call traces
_CALL = {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}


def _trace(*messages):
    return {"messages": [{"role": "user", "content": "1 + 2?"}, *messages], WHERE: "traces.jsonl:7"}


@pytest.mark.parametrize("messages,says", [
    ([{**_CALL, "tool_calls": [{"function": {"name": "add", "arguments": "[" * 100_000 + "]" * 100_000}}]}],
     "message 1: tool call 0: 'arguments' nest too deeply"),
    ([{**_CALL, "tool_calls": [{"function": {"name": "add", "arguments": {"a": json.loads("[" * 40 + "]" * 40)}}}]}],
     "'arguments' nest deeper than 32 levels"),
    ([{**_CALL, "tool_calls": [{"function": {"name": "add", "arguments": "{a: 1}"}}]}],
     "message 1: tool call 0: 'arguments' is not valid JSON"),
    ([{**_CALL, "tool_calls": [{"function": {"name": "add", "arguments": "[1, 2]"}}]}],
     "'arguments' must be an object (or a JSON string of one), got list"),
    ([{"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}],
     "message 1: a 'tool' message must follow an assistant message that made a tool call"),
    ([{"role": "assistant", "content": "3"}, {"role": "tool", "content": "3"}],
     "message 2: a 'tool' message must follow"),
    ([_CALL, {"role": "function", "content": "3"}, {"role": "assistant", "content": "3"}],
     "message 2: role 'function' (the old OpenAI function result) is not supported: give it role 'tool'"),
    ([{"role": "robot", "content": "3"}], "message 1: unknown role 'robot'"),
])
def test_malformed_tool_traces_are_refused_naming_the_row_and_message(messages, says):
    with pytest.raises(UserError) as e:
        parse_row(_trace(*messages), "sft")
    assert str(e.value).startswith("traces.jsonl:7: field 'messages' message ") and says in str(e.value), e.value


def test_a_call_written_in_the_answer_s_text_is_answered_by_a_tool_message():
    ex = parse_row(_trace({"role": "assistant", "content": "<tool_call>calculator(1+2)</tool_call>"},
                          {"role": "tool", "name": "calculator", "content": "3"},
                          {"role": "assistant", "content": "<answer>3</answer>"}), "sft")
    assert ex.prompt[-1] == {"role": "tool", "name": "calculator", "content": "3"}


def test_tool_calls_on_a_user_message_are_refused():
    row = {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
                        {"role": "assistant", "content": "x"}], WHERE: "t.jsonl:1"}
    with pytest.raises(UserError, match=r"t.jsonl:1: .*message 0: 'tool_calls' on a 'user' message"):
        parse_row(row, "sft")


def test_a_well_formed_trace_with_two_calls_and_their_answers_is_kept():
    two = {**_CALL, "tool_calls": _CALL["tool_calls"] * 2}
    ex = parse_row(_trace(two, {"role": "tool", "content": "3"}, {"role": "tool", "content": "3"},
                          {"role": "assistant", "content": "It is 3."}), "sft")
    calls = [m for m in ex.prompt + [ex.chosen] if isinstance(m, dict) and m.get("tool_calls")] \
        if isinstance(ex.prompt, list) else []
    assert calls and calls[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_a_jsonl_line_nested_too_deeply_is_a_one_line_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b"}\n{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(UserError, match=r"deep.jsonl:2: JSON nested too deeply to read"):
        load_source(DataSpec(str(path)))
