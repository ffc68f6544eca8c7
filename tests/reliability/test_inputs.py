"""Bad data, damaged or code-carrying models, special tokens typed by a user, reward-model truncation, and the
messages that used to be tracebacks or blamed the wrong thing."""

from __future__ import annotations

import gzip
import json
import os
import signal

import pytest

from dschat.config import DataArgs
from dschat.data.phases import load_phase
from dschat.data.sources import DataSpec, load_source
from dschat.errors import UserError
from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_model
from tests.helpers import run_cli
from tests.reliability.conftest import TRAIN, fresh_copy, one_line_error, sft_rows, write_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("tiny"))


# ------------------------------------------------------------------------------------------------------ data
def test_invalid_utf8_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", sft_rows(5))
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"plus", b"pl\xffus")
    path.write_bytes(b"".join(lines))
    proc = run_cli("data", "inspect", "--data", str(path))
    one_line_error(proc, f"{path}:3:", "not valid UTF-8", "0xff")


def test_binary_and_json_files(tmp_path):
    gz = tmp_path / "rows.jsonl"
    gz.write_bytes(gzip.compress(b'{"prompt": "a", "response": "b"}\n' * 50))
    with pytest.raises(UserError, match=rf"{gz}:1: not valid UTF-8 .* binary or compressed"):
        load_source(DataSpec(str(gz)))
    whole = tmp_path / "rows.json"
    whole.write_bytes(b'[{"prompt": "a", "response": "b"},\n {"prompt": "\xc3", "response": "b"}]')
    with pytest.raises(UserError, match=rf"{whole}:2: not valid UTF-8"):
        load_source(DataSpec(str(whole)))


def test_a_utf8_bom_is_accepted(tmp_path):
    rows = sft_rows(3)
    for name in ("bom.jsonl", "bom.json"):
        path = tmp_path / name
        body = "".join(json.dumps(r) + "\n" for r in rows) if name.endswith("l") else json.dumps(rows)
        path.write_bytes(b"\xef\xbb\xbf" + body.encode())
        got = load_source(DataSpec(str(path))).train
        assert [r["prompt"] for r in got] == [r["prompt"] for r in rows]


def test_an_edit_that_keeps_size_and_mtime_is_not_served_from_cache(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", sft_rows(20))
    stat = path.stat()
    args = DataArgs(data=[str(path)], data_split="1,0,0", eval_fraction=0.0, data_cache_dir=str(tmp_path / "c"))
    first = load_phase(args, 1, tok, seed=0, log=lambda _: None)
    path.write_text(path.read_text().replace("plus", "PLUS"))  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # touch -r / cp -p / rsync -t
    logs: list[str] = []
    second = load_phase(args, 1, tok, seed=0, log=logs.append)
    assert not any("from cache" in line for line in logs)
    assert first.train != second.train
    third = load_phase(args, 1, tok, seed=0, log=logs.append)  # unchanged now: the cache serves it, equal rows
    assert any("from cache" in line for line in logs) and third.train == second.train


@pytest.mark.parametrize("weight", ["-1", "abc", "0"])
def test_data_weight_messages(tmp_path, weight):
    path = write_jsonl(tmp_path / "d.jsonl", sft_rows(3))
    with pytest.raises(UserError, match="weight"):
        DataSpec.parse(f"{path}:{weight}")


def test_data_weight_message_from_the_cli(tmp_path, small_data):
    proc = run_cli(*TRAIN, "--data", f"{small_data}:-1", "--output-dir", str(tmp_path / "o"), "--max-steps", "1")
    one_line_error(proc, "weight '-1'", str(small_data))


# ----------------------------------------------------------------------------------------------------- models
def test_truncated_weights(trained, tmp_path):
    model = fresh_copy(trained / "model", tmp_path / "model")
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    proc = run_cli(*TRAIN, "--model", str(model), "--output-dir", str(tmp_path / "o"), "--max-steps", "1")
    one_line_error(proc, str(weights), "damaged weights", "truncated")


def test_damaged_header(trained, tmp_path):
    model = fresh_copy(trained / "model", tmp_path / "model")
    weights = model / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[8:20] = b"not a header"
    weights.write_bytes(bytes(blob))
    with pytest.raises(UserError, match=f"{weights}: damaged weights .damaged header"):
        create_causal_lm(str(model))


def test_remote_code_needs_the_flag(trained, tmp_path):
    model = fresh_copy(trained / "model", tmp_path / "model")
    marker = tmp_path / "REMOTE_CODE_RAN"
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="dschat_custom", architectures=["XModel"],
                  auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"})
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_x.py").write_text(f"open({str(marker)!r}, 'w')\n")
    proc = run_cli(*TRAIN, "--model", str(model), "--output-dir", str(tmp_path / "o"), "--max-steps", "1")
    one_line_error(proc, str(model), "--trust-remote-code")
    assert not marker.exists()


# -------------------------------------------------------------------------------------------- special tokens
def test_user_text_special_tokens_stay_text(tok):
    from dschat.data.usertext import encode_texts
    from dschat.generation.chat import encode_prompt

    eos, bos = tok.eos_token_id, tok.bos_token_id
    text = "\n\nHuman: </s><s> hello <pad>\n\nAssistant:"
    ids = encode_texts(tok, [text], [[text]], True)[0]
    assert ids[0] == bos and eos not in ids and bos not in ids[1:] and tok.pad_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text.lstrip(" ")
    ids = encode_prompt([{"role": "user", "content": "</s><s> where is my order?"}], tok)
    assert eos not in ids and ids.count(bos) == 1
    plain = "\n\nHuman: hello\n\nAssistant:"  # no special strings: exactly the tokenizer's own ids
    assert encode_texts(tok, [plain], [[plain]], True)[0] == tok(plain)["input_ids"]


def test_chat_template_markers_stay_tokens(tok):
    from dschat.data.formats import render_prompt
    from dschat.data.usertext import encode_one, prompt_parts

    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    messages = [{"role": "user", "content": "hi </s> there <s>"}]
    text = render_prompt(messages, tok)
    ids = encode_one(tok, text, prompt_parts(messages), add_special_tokens=False)
    assert ids.count(tok.eos_token_id) == 1 and ids.count(tok.bos_token_id) == 2  # the template's, not the user's
    safe = [{"role": "user", "content": "hi there"}]
    text = render_prompt(safe, tok)
    assert encode_one(tok, text, prompt_parts(safe), False) == tok(text, add_special_tokens=False)["input_ids"]


def test_training_rows_with_special_strings(tmp_path, tok):
    rows = [{"prompt": "\n\nHuman: say </s> please\n\nAssistant:", "response": " </s> done"}] * 4
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_phase(DataArgs(data=[str(path)], data_split="1,0,0", eval_fraction=0.0), 1, tok, 0, use_cache=False,
                      log=lambda _: None)
    ids = data.train[0]["input_ids"]
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id  # only the EOS the code appends


def test_reward_retokenization_keeps_bos(tok):
    from dschat.data.usertext import reencode_for_reward

    prompt, answer = "\n\nHuman: " + "long question " * 40 + "\n\nAssistant:", " short </s> answer"
    ids, cut = reencode_for_reward(prompt, answer, True, tok, 32)
    assert cut and len(ids) == 32 and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert ids.count(tok.eos_token_id) == 1
    text = tok.decode(ids[1:-1])
    assert "Assistant:" in text and text.endswith("short </s> answer")  # the prompt lost its start, not its end
    ids, cut = reencode_for_reward("\n\nHuman: hi\n\nAssistant:", " yes", False, tok, 32)
    assert not cut and ids == tok("\n\nHuman: hi\n\nAssistant:")["input_ids"] + tok(" yes", add_special_tokens=False)[
        "input_ids"]


# ---------------------------------------------------------------------------------------------------- messages
def test_a_user_reward_function_that_raises(tmp_path):
    from dschat.rewards.functions import RewardMixer

    path = tmp_path / "my_reward.py"
    path.write_text("def score(prompts, completions, **kw):\n"
                    "    return [1.0 / len(c) for c in completions]\n")
    spec = f"{path}:score"
    mixer = RewardMixer([spec])
    with pytest.raises(UserError) as e:
        mixer(["p0", "p1", "p2"], ["ok", "fine", ""])
    text = str(e.value)
    assert spec in text and "ZeroDivisionError" in text and "row 2" in text and "\n" not in text


def test_ctrl_c_during_shutdown_is_quiet(monkeypatch):
    """A second Ctrl-C while the interpreter joins threads on its way out used to print a stray traceback."""
    import threading

    from dschat.training.stage import sigint_unless_exiting

    with pytest.raises(KeyboardInterrupt):  # while running: Python's own Ctrl-C
        sigint_unless_exiting(signal.SIGINT, None)
    monkeypatch.setattr(threading.main_thread(), "is_alive", lambda: False)
    sigint_unless_exiting(signal.SIGINT, None)  # shutting down: nothing, no traceback
