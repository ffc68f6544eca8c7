"""``dschat chat``: one-shot and interactive modes through the real CLI, plus the prompt-fitting and streaming
pieces in-process on the tiny preset."""

import subprocess
import sys

import pytest

from dschat.cli.chat import ASSISTANT_PREFIX, interactive
from dschat.devices import pick_device
from dschat.errors import UserError
from dschat.generation.chat import _make_streamer, cut_at_stop, encode_prompt, fit_messages, held_back
from dschat.models.loading import resolve_saved_model
from tests.helpers import ROOT, run_cli


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from dschat.models.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny"))


# ------------------------------------------------------------------------------------------------ the CLI
def test_prompt_prints_one_answer_and_nothing_else():
    proc = run_cli("chat", "--model", "tiny", "--prompt", "你好", "--max-new-tokens", "8", "--seed", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    assert "dschat chat" not in proc.stdout and ASSISTANT_PREFIX not in proc.stdout  # no banner: pipeable
    assert proc.stdout.endswith("\n")


def test_greedy_answers_are_reproducible():
    args = ("chat", "--model", "tiny", "--prompt", "我的快递到哪了？", "--max-new-tokens", "12", "--greedy")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:]
    assert first.stdout.strip() and first.stdout == second.stdout


def test_interactive_session_answers_each_turn_and_clears():
    proc = subprocess.run([sys.executable, "-c", "from dschat.cli.main import cli; cli()", "chat", "--model", "tiny",
                           "--max-new-tokens", "8", "--seed", "0"],
                          input="你好\nclear\n再见\nquit\n这句不会被回答\n", cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(ASSISTANT_PREFIX) == 2  # 'quit' ended the session before the last line
    assert "(conversation cleared)" in proc.stdout
    answers = [line.split(ASSISTANT_PREFIX, 1)[1] for line in proc.stdout.splitlines() if ASSISTANT_PREFIX in line]
    assert all(a.strip() for a in answers)


def test_unknown_model_is_one_error_line():
    proc = run_cli("chat", "--model", "no-such-model-xyz", "--prompt", "hi", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dschat: error:") and "no-such-model-xyz" in lines[0]
    assert proc.stdout == ""


# ------------------------------------------------------------------------------------------ in-process parts
def test_plain_prompt_ends_at_the_assistant_marker(tiny_tokenizer):
    msgs = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "您好"},
            {"role": "user", "content": "再见"}]
    ids = encode_prompt(msgs, tiny_tokenizer)
    assert ids[0] == tiny_tokenizer.bos_token_id and ids[1] != tiny_tokenizer.bos_token_id
    text = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert text.endswith("Assistant:") and text.count("Human:") == 2


def test_fit_drops_oldest_turns_and_keeps_the_system_message(tiny_tokenizer):
    system = {"role": "system", "content": "你是客服。"}
    turns = [[{"role": "user", "content": f"第{i}个问题是关于快递的"}, {"role": "assistant", "content": f"第{i}个回答"}]
             for i in range(4)]
    msgs = [system] + [m for t in turns for m in t] + [{"role": "user", "content": "最后的问题"}]
    full = encode_prompt(msgs, tiny_tokenizer)
    kept, ids, dropped, cut = fit_messages(msgs, tiny_tokenizer, None)
    assert (kept, ids, dropped, cut) == (msgs, full, 0, False)

    # A budget just under the full length drops exactly the oldest turn (user + assistant), not the system.
    kept, ids, dropped, cut = fit_messages(msgs, tiny_tokenizer, len(full) - 1)
    assert dropped == 1 and not cut
    assert kept == [system] + [m for t in turns[1:] for m in t] + msgs[-1:]
    assert ids == encode_prompt(kept, tiny_tokenizer) and len(ids) < len(full)

    # Only the system message and the last question fit: every earlier turn goes.
    last = [system, msgs[-1]]
    kept, ids, dropped, cut = fit_messages(msgs, tiny_tokenizer, len(encode_prompt(last, tiny_tokenizer)))
    assert kept == last and dropped == 4 and not cut

    # Too small even for the last question: its tokens are cut from the left, keeping BOS and the end.
    kept, ids, dropped, cut = fit_messages(msgs, tiny_tokenizer, 5)
    assert cut and len(ids) == 5 and ids[0] == tiny_tokenizer.bos_token_id
    assert ids[1:] == encode_prompt(last, tiny_tokenizer)[-4:]


def test_stop_strings_are_cut_and_held_back():
    stops = ["\n\nHuman:", "\n\nAssistant:"]
    assert cut_at_stop("好的\n\nHuman: 还有", stops) == ("好的", True)
    assert cut_at_stop("好的", stops) == ("好的", False)
    assert held_back("好的\n\nHu", stops) == 4  # could still become "\n\nHuman:"
    assert held_back("好的\n", stops) == 1
    assert held_back("好的", stops) == 0
    assert held_back("x\n\nAssist", stops) == len("\n\nAssist")


def test_streamer_hides_the_next_turn_and_leading_space(tiny_tokenizer):
    written: list[str] = []
    streamer = _make_streamer(tiny_tokenizer, ["\n\nHuman:"], written.append)
    for chunk in (" 您好", "，请问", "\n", "\nHu", "man: 我还想", "问"):
        streamer.on_finalized_text(chunk)
    streamer.on_finalized_text("", stream_end=True)
    assert "".join(written) == "您好，请问"
    assert streamer.stopped

    written.clear()
    streamer = _make_streamer(tiny_tokenizer, ["\n\nHuman:"], written.append)
    for chunk in ("好的", "\n"):
        streamer.on_finalized_text(chunk)
    assert "".join(written) == "好的"  # the newline waits: it may start a stop string
    for chunk in ("\n请", "稍等 ", "\n"):
        streamer.on_finalized_text(chunk)
    assert "".join(written) == "好的\n\n请稍等"  # not a stop string after all; the trailing space waits
    streamer.on_finalized_text("", stream_end=True)
    assert "".join(written) == "好的\n\n请稍等"  # an answer's trailing whitespace is never shown


def test_stage_output_folder_stands_for_its_model(tmp_path):
    (tmp_path / "step1" / "model").mkdir(parents=True)
    (tmp_path / "step1" / "model" / "config.json").write_text("{}")
    assert resolve_saved_model(str(tmp_path / "step1")) == str(tmp_path / "step1" / "model")
    for sub in ("actor", "critic"):
        (tmp_path / "step3" / sub).mkdir(parents=True)
        (tmp_path / "step3" / sub / "config.json").write_text("{}")
    assert resolve_saved_model(str(tmp_path / "step3")) == str(tmp_path / "step3" / "actor")


class FakeBot:
    """Stands in for ``Chatbot``: records the conversation it is asked to answer and answers by number."""

    def __init__(self):
        self.seen: list[list[dict[str, str]]] = []

    def reply(self, messages, write):
        self.seen.append([dict(m) for m in messages])
        answer = f"回答{len(self.seen)}"
        write(answer)
        return answer, messages


def test_interactive_keeps_history_clears_it_and_ends_at_eof(monkeypatch):
    import io

    bot, out = FakeBot(), io.StringIO()
    monkeypatch.setattr("sys.stdin", io.StringIO("你好\n\n  \n还在吗\nclear\n再见\n"))  # then end of input
    interactive(bot, "你是客服。", out, "banner")
    system = {"role": "system", "content": "你是客服。"}
    assert bot.seen == [
        [system, {"role": "user", "content": "你好"}],
        [system, {"role": "user", "content": "你好"}, {"role": "assistant", "content": "回答1"},
         {"role": "user", "content": "还在吗"}],
        [system, {"role": "user", "content": "再见"}],  # 'clear' kept only the system message
    ]
    text = out.getvalue()
    assert text.startswith("banner\n") and text.count(ASSISTANT_PREFIX) == 3 and "(conversation cleared)" in text


def test_bad_device_is_a_user_error():
    with pytest.raises(UserError, match="--device"):
        pick_device("nonsense")
    assert str(pick_device("cpu")) == "cpu"


# ------------------------------------------------------------------------------------------ declared flags
def test_agent_flags_reach_the_agent(monkeypatch, tmp_path):
    """--tools, --env, --env-column, --max-turns, --tool-timeout and --tool-max-output are AgentArgs' flags, and
    build_agent gets them as given."""
    from click.testing import CliRunner

    from dschat.cli.chat import chat_command
    from dschat.config import AgentArgs

    got = []

    def build_agent(args):
        got.append(args)
        raise UserError("stop before the model loads")

    monkeypatch.setattr("dschat.agents.agent.build_agent", build_agent)
    result = CliRunner().invoke(chat_command, [
        "--model", "tiny", "--prompt", "hi", "--tools", "calculator", "--env", "a.py:A", "--env", "b.py:B",
        "--env-column", "task", "--max-turns", "3", "--tool-timeout", "2.5", "--tool-max-output", "77"])
    assert isinstance(result.exception, UserError) and "stop before" in str(result.exception), result.output
    [args] = got
    assert isinstance(args, AgentArgs)
    assert (args.tools, args.env, args.env_column, args.max_turns, args.tool_timeout, args.tool_max_output) == \
        (["calculator"], ["a.py:A", "b.py:B"], "task", 3, 2.5, 77)


@pytest.mark.parametrize("args, says", [
    (["--tool-timeout", "5"], "--tool-timeout has no effect without --tools or --env"),
    (["--tool-max-output", "10"], "--tool-max-output has no effect without --tools or --env"),
    (["--max-turns", "2"], "--max-turns has no effect without --tools or --env"),
    (["--tools", "calculator", "--env-column", "task"], "--env-column has no effect without two or more --env"),
    (["--greedy", "--temperature", "0.5"], "--temperature has no effect with --greedy"),
    (["--greedy", "--seed", "3"], "--seed has no effect with --greedy"),
    (["--top-p", "1.5"], "--top-p must be <= 1"),
    (["--temperature", "0"], "for greedy decoding pass --greedy"),
])
def test_a_flag_that_does_nothing_or_is_out_of_range_is_refused(args, says):
    from click.testing import CliRunner

    from dschat.cli.chat import chat_command

    result = CliRunner().invoke(chat_command, ["--model", "tiny", "--prompt", "hi", *args])
    assert isinstance(result.exception, UserError) and says in str(result.exception), result.output


def test_an_inert_flag_is_one_line_and_exit_code_2():
    proc = run_cli("chat", "--model", "tiny", "--prompt", "hi", "--tool-timeout", "5")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "dschat: error: --tool-timeout has no effect without --tools or --env"
