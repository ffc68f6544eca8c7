"""Tools and environments (dschat.agents): the calculator's safety, tool schemas and faults, call parsing, the
episode driver row by row, the decode loop's episodes against a full forward, and whose tokens learn."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from dschat.agents.agent import Agent
from dschat.agents.calls import CallError, TurnText, parse_call
from dschat.agents.env import load_envs
from dschat.agents.tools import ToolRunner, calculator, load_tools, tool_from_function
from dschat.errors import UserError


@pytest.fixture(scope="module")
def tok() -> Any:
    from dschat.models.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny"))


# ------------------------------------------------------------------------------------------------ the calculator
@pytest.mark.parametrize("expr, value", [("13*17", "221"), ("(2 + 3) * 4 - 1", "19"), ("7 / 2", "3.5"),
                                         ("2 ** 10", "1024"), ("-3 + 10 // 3", "0"), ("10 % 4", "2"),
                                         ("6 × 7", "42"), ("1.5 * 4", "6")])
def test_calculator_evaluates_arithmetic(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('echo hacked')", "open('/etc/passwd').read()",
                                  "(lambda: 1)()", "x + 1", "[1, 2]", "'a' * 3", "1 if 1 else 2", "2 ** 10000",
                                  "9 ** 9 ** 9", "1 / 0", "().__class__", "1" * 300, "1e308 * 10"])
def test_calculator_never_evaluates_code(expr):
    with pytest.raises(ValueError):
        calculator(expr)


# ------------------------------------------------------------------------------------------------ tools
def _tools_file(tmp_path, body: str) -> str:
    f = tmp_path / "my_tools.py"
    f.write_text(body, encoding="utf-8")
    return str(f)


def test_a_function_s_signature_and_docstring_are_its_schema(tmp_path):
    def lookup(city: str, days: int = 1, metric: bool = True) -> str:
        """Look up the weather of a city.

        Args:
            city: the city's name.
            days: how many days ahead,
                counted from today.
        """
        return city

    schema = tool_from_function(lookup).schema()
    assert schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather of a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name."},
            "days": {"type": "integer", "description": "how many days ahead, counted from today."},
            "metric": {"type": "boolean"}}}, "return": {"type": "string"}}}
    assert load_tools(["calculator"])[0].schema()["function"]["parameters"]["required"] == ["expression"]


def test_tool_specs_that_cannot_load_are_one_line_errors(tmp_path):
    f = _tools_file(tmp_path, "def echo(text: str) -> str:\n    return text\nNOT = 3\n")
    assert [t.name for t in load_tools([f"{f}:echo", "calc=calculator"])] == ["echo", "calc"]
    for spec, match in [(f"{tmp_path / 'no.py'}:echo", "not found"), (f"{f}:missing", "has no 'missing'"),
                        (f"{f}:NOT", "not a function"), ("abacus", "not a built-in"),
                        (f"{f}:echo", "two tools named 'echo'")]:
        with pytest.raises(UserError, match=match):
            load_tools([f"{f}:echo", spec] if "two tools" in match else [spec])


def test_faulty_tools_become_error_messages_and_are_counted(tmp_path, capsys):
    f = _tools_file(tmp_path, (
        "import time\n"
        "def sleepy(text: str) -> str:\n    time.sleep(5)\n    return 'late'\n"
        "def boom(text: str) -> str:\n    raise RuntimeError('kaput')\n"
        "def chatty(text: str) -> None:\n    print('x' * 1_000_000)\n"
        "def big(text: str) -> str:\n    return 'y' * 1_000_000\n"
        "def junk(text: str):\n    return object()\n"
        "def fine(text: str) -> dict:\n    return {'echo': text}\n"))
    tools = load_tools([f"{f}:{n}" for n in ("sleepy", "boom", "chatty", "big", "junk", "fine")])
    runner = ToolRunner(tools, timeout=0.3, max_output=100)
    t0 = time.monotonic()
    results = {n: runner.call(n, {"text": "hi"}).wait() for n in ("sleepy", "boom", "chatty", "big", "junk", "fine")}
    assert time.monotonic() - t0 < 3  # the sleeping tool is killed at its timeout
    assert (results["sleepy"].error, results["sleepy"].text) == ("timeout", "error: sleepy timed out after 0.3 s")
    assert results["boom"].error == "raised" and results["boom"].text == "error: boom raised RuntimeError: kaput"
    for name, char in (("chatty", "x"), ("big", "y")):  # printed or returned, a megabyte comes back capped
        assert results[name].error is None and results[name].truncated
        assert results[name].text == char * 100 + " ...[truncated]"
    assert results["junk"].error == "junk" and "returned a object" in results["junk"].text
    assert results["fine"].text == '{"echo": "hi"}' and results["fine"].error is None
    assert "xxxx" not in capsys.readouterr().out  # a tool's prints never reach the run's output
    assert runner.call("nope", {}).wait().error == "unknown_tool"
    assert runner.call("fine", {}).wait().error == "bad_arguments"
    assert runner.call("fine", {"text": "a", "extra": 1}).wait().error == "bad_arguments"


# ------------------------------------------------------------------------------------------------ calls and turns
def test_calls_parse_as_json_or_the_short_form():
    one = {"calculator": "expression"}
    assert parse_call('{"name": "calculator", "arguments": {"expression": "1+2"}}', one).arguments == \
        {"expression": "1+2"}
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}', one).arguments == {"a": 1}
    assert parse_call(" calculator(13 * 17) ", one).arguments == {"expression": "13 * 17"}
    assert parse_call('calculator("2+2")', one).arguments == {"expression": "2+2"}
    for body, match in [('{"name": "calculator", "arguments": {"expression": ', "not JSON"), ("", "empty"),
                        ("[1, 2]", "a call is"), ('{"arguments": {}}', "must be"), ("lookup(x)", "short form"),
                        ('{"name": "f", "arguments": [1]}', "must be an object"), ("just text", "a call is")]:
        with pytest.raises(CallError, match=match):
            parse_call(body, one)


def test_plain_turns_and_a_template_s_own(tok):
    plain = TurnText(tok)
    assert not plain.template
    assert plain.tool_result("221") == " <tool_response>221</tool_response>"
    assert plain.observation("too low") == "\n\nHuman: too low\n\nAssistant:"

    class Templated:  # a Hermes-style template (Qwen2.5's shape) without a download
        eos_token = "<|im_end|>"
        chat_template = "... tools ... tool ..."

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            out = ""
            for m in messages:
                role = "user" if m["role"] == "tool" else m["role"]
                content = f"<tool_response>\n{m['content']}\n</tool_response>" if m["role"] == "tool" \
                    else m["content"]
                out += f"<|im_start|>{role}\n{content}<|im_end|>\n"
            return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    t = TurnText(Templated())
    assert t.template
    assert t.tool_result("221") == \
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n221\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert t.observation("too low") == "\n<|im_start|>user\ntoo low<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------ episodes
class CountDown:
    """An environment that never says done: it answers every turn with how many remain."""

    def reset(self, row):
        self.n = 0
        return None

    def step(self, text):
        self.n += 1
        return f"again {self.n}", 0.5, False


class Broken:
    def reset(self, row):
        return None

    def step(self, text):
        raise KeyError("no such state")


def _agent(tools=("calculator",), envs=None, max_turns=4, timeout=5.0) -> Agent:
    tools_ = load_tools(list(tools))
    return Agent(tools_, ToolRunner(tools_, timeout, 200), envs or {}, "env", max_turns)


def _drive(episodes, scripts: list[list[int]], pad: int, steps: int = 200) -> list[list[tuple[int, bool, bool]]]:
    """Run the driver over scripted policy tokens (each row's script consumed only where the row samples):
    each row's (token, real, policy) per step."""
    from dschat.agents.episode import Episodes

    assert isinstance(episodes, Episodes)
    episodes.start()
    at = [0] * len(scripts)
    out: list[list[tuple[int, bool, bool]]] = [[] for _ in scripts]
    for _ in range(steps):
        sampled = torch.tensor([s[at[i]] if at[i] < len(s) else pad for i, s in enumerate(scripts)])
        toks, real, policy, done = episodes.advance(sampled)
        for i in range(len(scripts)):
            out[i].append((int(toks[i]), bool(real[i]), bool(policy[i])))
            at[i] += bool(policy[i])
        if bool(done.all()):
            break
    return out


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_driver_runs_calls_and_forces_results_row_by_row(tok):
    from dschat.agents.episode import Episodes

    eos = tok.eos_token_id
    call = _ids(tok, " <tool_call>calculator(13*17)</tool_call>")
    answer = _ids(tok, "<answer>221</answer>") + [eos]
    broken = _ids(tok, ' <tool_call>{"name": "calculator", "arguments": </tool_call>') + [eos]
    scripts = [call + answer, _ids(tok, " plain") + [eos], broken]
    ep = Episodes(_agent(), tok, [{}, {}, {}], [eos], tok.pad_token_id)
    out = _drive(ep, scripts, tok.pad_token_id)
    text = [tok.decode([t for t, r, _ in row if r]) for row in out]
    assert text[0] == (" <tool_call>calculator(13*17)</tool_call>  <tool_response>221</tool_response> "
                       "<answer>221</answer></s>")  # each turn encoded on its own (a dummy prefix each)
    policy = [tok.decode([t for t, r, p in row if p]) for row in out]
    assert policy[0] == " <tool_call>calculator(13*17)</tool_call> <answer>221</answer></s>"  # the result: context
    assert text[1] == " plain</s>" and all(p for _, r, p in out[1] if r)
    assert "error: the call is not JSON" in text[2]  # a malformed call: an error turn, then the policy goes on
    assert ep.finished() == [True, True, True]
    info = ep.info(torch.tensor([[t for t, _, _ in row] + [tok.pad_token_id] * (len(out[0]) - len(row))
                                 for row in out]),
                   torch.tensor([[r for _, r, _ in row] + [False] * (len(out[0]) - len(row)) for row in out]))
    assert info.calls == [1, 0, 1] and info.errors == [0, 0, 1] and info.turns == [2, 1, 2]
    assert [st.counts.kinds["tool_malformed"] for st in ep.state] == [0, 0, 1]  # counted by kind, in its row


def test_a_waiting_row_does_not_hold_the_others_back(tok, tmp_path):
    from dschat.agents.episode import Episodes

    f = _tools_file(tmp_path, "import time\ndef slow(text: str) -> str:\n    time.sleep(0.6)\n    return 'ok'\n")
    eos = tok.eos_token_id
    agent = _agent(tools=(f"{f}:slow",))
    long_answer = _ids(tok, " one two three four five six seven eight nine ten") * 20 + [eos]
    ep = Episodes(agent, tok, [{}, {}], [eos], tok.pad_token_id)
    t0 = time.monotonic()
    out = _drive(ep, [_ids(tok, " <tool_call>slow(x)</tool_call>") + [eos], long_answer], tok.pad_token_id,
                 steps=2000)
    waited = [i for i, (_, r, _) in enumerate(out[0]) if not r]
    assert waited, "the calling row fed masked columns while its tool ran"
    # meanwhile the other row sampled on: its tokens in the same steps are its own policy tokens
    assert all(out[1][i][2] for i in waited if i < len(out[1]))
    assert time.monotonic() - t0 >= 0.5
    assert tok.decode([t for t, r, _ in out[0] if r]).endswith("<tool_response>ok</tool_response></s>")


def test_an_environment_that_never_says_done_is_cut_at_max_turns(tok):
    from dschat.agents.episode import Episodes

    eos = tok.eos_token_id
    turn = _ids(tok, " guess") + [eos]
    agent = _agent(tools=(), envs={"CountDown": CountDown, "Broken": Broken}, max_turns=3)
    ep = Episodes(agent, tok, [{"env": "CountDown"}, {"env": "Broken"}], [eos], tok.pad_token_id)
    out = _drive(ep, [turn * 10, turn * 10], tok.pad_token_id)
    text = tok.decode([t for t, r, _ in out[0] if r])
    assert text.count("guess") == 3 and "again 2" in text and "again 3" not in text
    assert ep.finished() == [False, False]  # cut, and broken: neither ended on its own
    assert [st.env_reward for st in ep.state] == [1.5, 0.0] and ep.state[1].counts.errors == 1
    with pytest.raises(UserError, match="names no --env"):
        Episodes(agent, tok, [{"env": "Nope"}], [eos], tok.pad_token_id).start()


def test_environments_load_by_name(tmp_path):
    f = tmp_path / "envs.py"
    f.write_text("class Guess:\n    def reset(self, row):\n        return None\n    def step(self, text):\n"
                 "        return None, 1.0, True\nclass NotAnEnv:\n    pass\n", encoding="utf-8")
    assert list(load_envs([f"{f}:Guess", f"other={f}:Guess"])) == ["Guess", "other"]
    with pytest.raises(UserError, match="reset\\(row\\) and step\\(text\\)"):
        load_envs([f"{f}:NotAnEnv"])


# ------------------------------------------------------------------------------------------------ the decode loop
def scripted_policy(monkeypatch, script_of) -> None:
    """``script_policy`` for one test: the policy writes ``script_of(row)``, then EOS."""
    from dschat.agents import episode as EP
    from tests.dschat.scripted import script_policy

    monkeypatch.setattr(EP.Episodes, "step_row", EP.Episodes.step_row)  # restored after the test
    script_policy(script_of)


def _scripted_rollout(tok, monkeypatch, agent: Agent, scripts: list[list[int]], prompts: list[str],
                      rows: list[dict[str, Any]] | None = None, max_new_tokens: int = 120):
    """A rollout of the tiny model where each row's policy tokens follow ``scripts`` (the loop's sampled tokens
    replaced), through the hybrid engine and ``generate_rollout`` as stage 3 samples."""
    from transformers import AutoModelForCausalLM

    from dschat.generation.decode import GenerationConfig
    from dschat.generation.hybrid_engine import HybridEngine
    from dschat.models.loading import resolve_model
    from dschat.rlhf.rollout import generate_rollout

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    batch = {"prompt": enc.input_ids, "prompt_att_mask": enc.attention_mask,
             "answer": [None] * len(prompts), "extra": rows or [{} for _ in prompts]}
    scripted_policy(monkeypatch, lambda row: scripts[row])
    hybrid = HybridEngine(model, tok.pad_token_id, tok.eos_token_id, backend="dschat", agent=agent)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, logprobs=True)
    rollout, _ = generate_rollout(hybrid, tok, batch, gen)
    return model, rollout


def test_episode_log_probs_equal_a_full_forward_and_tool_tokens_are_context(tok, monkeypatch, tmp_path):
    """The loop's cache (tool results forced in, masked columns while a tool runs) gives the log-probs a full
    forward over the finished episode gives; the action mask holds the policy's tokens alone, the attention mask
    every token fed."""
    from dschat.rlhf.rollout import answer_logprobs, completion_texts

    f = _tools_file(tmp_path, "import time\ndef slow(text: str) -> str:\n    time.sleep(0.3)\n    return 'ok'\n")
    eos = tok.eos_token_id
    agent = _agent(tools=("calculator", f"{f}:slow"))
    scripts = [_ids(tok, " <tool_call>calculator(13*17)</tool_call>") + _ids(tok, "<answer>221</answer>") + [eos],
               _ids(tok, " <tool_call>slow(x)</tool_call>") + _ids(tok, " fine") + [eos],
               _ids(tok, " nothing to call here at all") + [eos]]
    model, r = _scripted_rollout(tok, monkeypatch, agent, scripts,
                                 ["\n\nHuman: What is 13 * 17?\n\nAssistant:", "\n\nHuman: slow\n\nAssistant:",
                                  "\n\nHuman: hi\n\nAssistant:"])
    P = r.prompt_len
    real = r.attention_mask[:, P:].bool()
    assert (r.action_mask.bool() & ~real).sum() == 0
    for i, s in enumerate(scripts):  # the policy's tokens are exactly the script, the rest context
        assert r.sequences[i, P:][r.action_mask[i].bool()].tolist() == s
    assert r.episode is not None and r.episode.calls == [1, 1, 0] and r.reached_eos.tolist() == [True] * 3
    gaps = (~real[1]).nonzero().flatten().tolist()  # row 1 waited on its tool: masked columns mid-answer
    assert gaps and gaps[0] < int(real[1].nonzero().max())
    _, texts, _ = completion_texts(tok, r, r.attention_mask[:, :P])
    assert texts[0] == (" <tool_call>calculator(13*17)</tool_call>  <tool_response>221</tool_response> "
                        "<answer>221</answer>")
    assert r.logprobs is not None
    full = answer_logprobs(model, r)
    assert torch.allclose(full, r.logprobs, atol=1e-5)
    assert (full[~r.action_mask.bool()] == 0).all()


def test_tool_tokens_carry_no_gradient_and_the_loss_is_the_policy_tokens_loss(tok, monkeypatch):
    """An episode's GRPO loss equals the loss over its policy tokens alone (gathered into a single-turn layout),
    and the gradient reaching the log-probs of tool tokens is zero."""
    from dschat import losses as L
    from dschat.rlhf.rollout import answer_logprobs

    eos = tok.eos_token_id
    scripts = [_ids(tok, " <tool_call>calculator(2+2)</tool_call>") + _ids(tok, "<answer>4</answer>") + [eos],
               _ids(tok, " <tool_call>calculator(3*3)</tool_call>") + _ids(tok, " 9") + [eos]]
    model, r = _scripted_rollout(tok, monkeypatch, _agent(), scripts, ["\n\nHuman: 2+2?\n\nAssistant:"] * 2)
    logps = answer_logprobs(model, r)
    logps.retain_grad()
    adv = torch.tensor([1.0, -0.5])
    old = logps.detach() - 0.05 * r.action_mask  # a ratio away from 1 where the policy wrote
    out = L.grpo_policy_loss(logps, old, adv, r.action_mask, 0.2, 0.2, loss_type="grpo")
    out.loss.backward()
    context = r.attention_mask[:, r.prompt_len:].bool() & ~r.action_mask.bool()
    assert context.any() and (logps.grad[context] == 0).all() and (logps.grad[r.action_mask.bool()] != 0).all()
    # the same rows as single turns: each row's policy tokens alone, left-aligned, nothing else
    n = int(r.action_mask.sum(-1).max())
    dense = torch.zeros(2, n)
    dense_old = torch.zeros(2, n)
    mask = torch.zeros(2, n, dtype=torch.long)
    for i in range(2):
        keep = r.action_mask[i].bool()
        k = int(keep.sum())
        dense[i, :k], dense_old[i, :k], mask[i, :k] = logps.detach()[i, keep], old[i, keep], 1
    single = L.grpo_policy_loss(dense, dense_old, adv, mask, 0.2, 0.2, loss_type="grpo")
    assert torch.allclose(out.loss.detach(), single.loss, atol=1e-6)


# ------------------------------------------------------------------------------------------------ stage 3
def _env_file(tmp_path) -> str:
    f = tmp_path / "guess_env.py"
    f.write_text(
        "class Guess:\n"
        "    '''Guess the row's answer: each wrong turn is told higher or lower.'''\n"
        "    def reset(self, row):\n        self.answer = int(row.get('answer') or 0)\n        return None\n"
        "    def step(self, text):\n"
        "        digits = ''.join(ch for ch in text if ch.isdigit())\n"
        "        if digits and int(digits) == self.answer:\n            return None, 1.0, True\n"
        "        return 'higher' if not digits or int(digits) < self.answer else 'lower', 0.0, False\n"
        "class Forever:\n    def reset(self, row):\n        return 'start'\n"
        "    def step(self, text):\n        return 'more', 0.1, False\n", encoding="utf-8")
    return str(f)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "rloo", "reinforce_pp", "remax", "ppo", "online_dpo"])
def test_every_sampling_algorithm_trains_on_episodes(tmp_path, monkeypatch, tok, algo):
    """Two steps of each algorithm that samples, its policy scripted to call the calculator (even rows) or a tool
    that raises (odd rows) and then answer: the episodes run, the errors are counted, training goes on."""
    from dschat.config import build_config
    from dschat.rlhf.config import RLHFConfig
    from tests.helpers import read_json, read_jsonl
    from tests.helpers import run_stage as run

    f = _tools_file(tmp_path, "def boom(text: str) -> str:\n    raise ValueError('no')\n")
    out = tmp_path / algo
    # room for the masked columns a row feeds while its tool's worker answers (as many as the other rows sample
    # meanwhile, which depends on the machine's load) besides the call, its result and the answer
    values = {"algo": algo, "actor_model": "tiny", "max_answer_seq_len": 192, "per_device_train_batch_size": 4,
              "output_dir": str(out), "max_steps": 2, "progress": False, "max_eval_rows": 2,
              "per_device_eval_batch_size": 2, "tools": ["calculator", f"{f}:boom"], "max_turns": 2,
              "per_device_generation_batch_size": 2}
    if algo == "ppo":
        values.update(reward_model="tiny", reward_funcs=["rm", "format"])
    else:
        values.update(num_generations=2, reward_funcs=["format"])
    calls = [_ids(tok, " <tool_call>calculator(2+2)</tool_call>"), _ids(tok, " <tool_call>boom(x)</tool_call>")]
    answer = _ids(tok, " <think>x</think><answer>4</answer>")
    scripted_policy(monkeypatch, lambda row: calls[row % 2] + answer)
    run(build_config(RLHFConfig, values))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "episode/turns" in r]
    assert len(rows) == 2
    for r in rows:  # every episode: a call, its result, the answer
        assert (r["episode/turns"], r["episode/tool_calls"]) == (2.0, 1.0)
        assert r["episode/tool_raised"] > 0 and 0 < r["episode/tool_errors"] < 1
        assert 0 < r["episode/masked_token_frac"] < 1 and r.get("train/reward/format", 1.0) == 1.0
    assert read_json(out / "eval.json")["steps"] == 2


@pytest.mark.slow
def test_an_environment_owns_the_reward_and_a_column_picks_it(tmp_path, monkeypatch, tok):
    """GRPO with two environments chosen per row by the data's ``env`` column, the policy scripted to guess 3 and
    then end its turns: the guess environment ends an episode, the other one is cut at --max-turns."""
    from dschat.config import build_config
    from dschat.rlhf.config import RLHFConfig
    from tests.helpers import read_json, read_jsonl
    from tests.helpers import run_stage as run

    env = _env_file(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "\n\nHuman: guess my number\n\nAssistant:", "answer": str(i % 7),
                                        "env": "guess" if i % 2 else "forever"}) + "\n" for i in range(40)))
    out = tmp_path / "out"
    cfg = build_config(RLHFConfig, {
        "algo": "grpo", "actor_model": "tiny", "data": [str(data)], "data_split": "0,0,1", "max_answer_seq_len": 64,
        "output_dir": str(out), "max_steps": 2, "progress": False, "max_eval_rows": 2, "num_generations": 2,
        "per_device_generation_batch_size": 2, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 2,
        "env": [f"guess={env}:Guess", f"forever={env}:Forever"], "max_turns": 3})
    assert cfg.reward_func_names() == ["env"]
    scripted_policy(monkeypatch, lambda row: _ids(tok, " 3"))
    run(cfg)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "episode/turns" in r]
    assert len(rows) == 2 and all(1 <= r["episode/turns"] <= 3 for r in rows) and "train/reward/env" in rows[0]
    assert any(r["episode/turns"] > 1 for r in rows) and all(r["episode/masked_token_frac"] > 0 for r in rows)
    assert "reward_env_before" in read_json(out / "eval.json")


def test_flags_that_do_nothing_without_tools_are_refused(tmp_path):
    from dschat.config import build_config, refuse_inert
    from dschat.rlhf.config import RLHFConfig, check_config

    with pytest.raises(UserError, match="--max-turns has no effect without --tools or --env"):
        refuse_inert(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "max_turns": 3}), {"max_turns"})
    with pytest.raises(UserError, match="--tools has no effect with --algo dpo"):
        refuse_inert(build_config(RLHFConfig, {"algo": "dpo", "actor_model": "tiny", "tools": ["calculator"]}),
                     {"tools"})
    with pytest.raises(UserError, match="needs --env"):
        check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "reward_funcs": ["env"]}))
    check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny", "tools": ["calculator"],
                                           "generation_backend": "hf"}))  # turn by turn (generation.turns)
    with pytest.raises(UserError, match="not found"):
        check_config(build_config(RLHFConfig, {"algo": "grpo", "actor_model": "tiny",
                                               "tools": [f"{tmp_path}/none.py:f"]}))


# ------------------------------------------------------------------------------------------------ SFT on tool traces
TRACE = [{"role": "user", "content": "What is 13 * 17?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"type": "function", "function": {"name": "calculator", "arguments": "{\"expression\": \"13*17\"}"}}]},
         {"role": "tool", "name": "calculator", "content": "221"},
         {"role": "assistant", "content": "<answer>221</answer>"}]


def _sft_row(tmp_path, tok, row):
    from dschat.config import DataArgs
    from dschat.data import load_phase
    from dschat.utils import write_jsonl

    path = tmp_path / "trace.jsonl"
    write_jsonl([row], path)
    args = DataArgs(data=[str(path)], data_split="1,0,0", eval_fraction=0.0)
    return load_phase(args, 1, tok, seed=0, use_cache=False, log=lambda _: None).train[0]


def test_sft_trains_the_assistant_turns_of_a_tool_trace_and_not_the_tool_turn(tmp_path, tok):
    """Plain format: the call is the assistant's (trained), the tool's result is context, the answer after it is
    trained again; the text is what an episode writes, so SFT and RL see the same tokens."""
    row = _sft_row(tmp_path, tok, {"messages": TRACE})
    ids, labels = row["input_ids"], row["labels"]
    text = tok.decode(ids)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "13*17"}}</tool_call>'
    # the turns as SFT encodes them, each on its own (the tiny tokenizer's dummy prefix before each)
    assert text == f"<s> \n\nHuman: What is 13 * 17?\n\nAssistant:  {call}  <tool_response>221</tool_response>  " \
                   "<answer>221</answer></s>"
    trained = [t for t, y in zip(ids, labels, strict=True) if y != -100]
    assert tok.decode(trained) == f" {call}  <answer>221</answer></s>"
    masked = tok.decode([t for t, y in zip(ids, labels, strict=True) if y == -100])
    assert "<tool_response>221</tool_response>" in masked
    # the tool turn's ids are those an episode forces after the call closes (Episodes._ids of TurnText.tool_result)
    from dschat.agents.calls import TurnText

    turn = tok(TurnText(tok).tool_result("221"), add_special_tokens=False)["input_ids"]
    assert any(ids[i: i + len(turn)] == turn for i in range(len(ids)))


HERMES = ("{%- if tools %}[system] tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}\n{% endif %}"
          "{%- for m in messages %}"
          "{%- if m['role'] == 'assistant' %}[assistant] {{ m['content'] }}"
          "{%- for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
          "</s>\n"
          "{%- elif m['role'] == 'tool' %}[user] <tool_response>{{ m['content'] }}</tool_response></s>\n"
          "{%- else %}[{{ m['role'] }}] {{ m['content'] }}</s>\n{% endif %}{% endfor %}"
          "{%- if add_generation_prompt %}[assistant] {% endif %}")


def test_a_template_renders_the_tool_call_the_tool_turn_and_the_tool_list(tmp_path):
    """A chat template that renders tools (Hermes-style, as Qwen2.5's does): the call is written by the template
    and trained, the tool's turn is context, the run's tool list is rendered into the prompt, and an episode's
    turns are the template's own."""
    from dschat.data.formats import render_prompt
    from dschat.models.loading import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("tiny"))
    tok.chat_template = HERMES
    row = _sft_row(tmp_path, tok, {"messages": TRACE})
    ids, labels = row["input_ids"], row["labels"]
    trained = tok.decode([t for t, y in zip(ids, labels, strict=True) if y != -100])
    assert '<tool_call>{"arguments": {"expression": "13*17"}, "name": "calculator"}</tool_call>' in trained \
        or '<tool_call>{"name": "calculator", "arguments": {"expression": "13*17"}}</tool_call>' in trained
    assert "221</answer>" in trained and "<tool_response>" not in trained
    assert "[user] <tool_response>221</tool_response>" in tok.decode(ids)
    schema = load_tools(["calculator"])[0].schema()
    assert render_prompt(TRACE[:1], tok, [schema]).startswith("[system] tools: calculator")
    turns = TurnText(tok)
    assert turns.template
    # the turn's end first (the policy wrote the call, the template closes its turn), then the tool's turn
    assert turns.tool_result("221") == "</s>[user] <tool_response>221</tool_response></s>[assistant] "
    assert turns.observation("lower") == "[user] lower</s>\n[assistant] "  # after the policy's own EOS


@pytest.mark.slow
def test_pipeline_tools_runs_sft_then_grpo_with_the_calculator_and_both_evaluations(tmp_path):
    from dschat.demo import demo_files
    from dschat.training.pipeline import TOOLS_SFT_FOLDER
    from tests.helpers import read_json, run_cli

    out = tmp_path / "pipe"
    proc = run_cli("pipeline", "tools", "--output-dir", str(out), "--sft-args", "--max-steps 10 --no-progress",
                   "--rl-args", "--max-steps 2 --max-eval-rows 8 --max-answer-seq-len 40 --no-progress",
                   "--eval-args", "--max-eval-rows 8 --max-new-tokens 40", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TOOLS with the tool" in proc.stdout and "the tool's gain" in proc.stdout
    report = read_json(out / "pipeline.json")
    assert set(report["seconds"]) == {"sft", "tools", "eval_before", "eval_after"}
    assert report["tools_reward_funcs"] == ["accuracy"] and report["tools_eval_prompts_after"] == 8
    for when in ("before", "after"):
        assert report[f"tools_with_{when}"] is not None and report[f"tools_without_{when}"] is not None
    args = read_json(out / "step3_tools" / "args.json")
    assert args["algo"] == "grpo" and args["tools"] == ["calculator"] and args["reward_funcs"] == ["accuracy"]
    assert read_json(out / TOOLS_SFT_FOLDER / "args.json")["data"] == [str(demo_files()["tools_sft"])]
    ev = read_json(out / "tools_eval_after.json")
    assert ev["tools"] == ["calculator"] and ev["baseline_tools"] is False


# ------------------------------------------------------------------------------------------------ the other commands
def test_chat_shows_each_call_and_its_result_as_it_happens(tok, monkeypatch):
    from transformers import AutoModelForCausalLM

    from dschat.generation.chat import Chatbot
    from dschat.models.loading import resolve_model

    scripted_policy(monkeypatch, lambda row: _ids(tok, " <tool_call>calculator(6*7)</tool_call>")
                    + _ids(tok, " <answer>42</answer>"))
    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny")).eval()
    bot = Chatbot(model, tok, torch.device("cpu"), max_new_tokens=80, greedy=True, temperature=0.0, top_p=1.0,
                  top_k=0, repetition_penalty=1.0, log=lambda _: None, agent=_agent())
    shown: list[str] = []
    answer, _ = bot.reply([{"role": "user", "content": "6 times 7?"}], shown.append)
    text = "".join(shown)
    assert "[call] calculator(6*7)" in text and "[result] 42" in text and text.rstrip().endswith("<answer>42</answer>")
    assert answer.endswith("<answer>42</answer>") and "<tool_response>42</tool_response>" in answer


def test_generate_writes_whole_episodes(tmp_path, tok, monkeypatch):
    from dschat.apps.best_of_n import GenerateConfig, generate
    from dschat.config import build_config
    from dschat.demo import demo_files
    from dschat.utils import read_jsonl_rows

    scripted_policy(monkeypatch, lambda row: _ids(tok, " <tool_call>calculator(6*7)</tool_call>")
                    + _ids(tok, " <answer>42</answer>"))
    out = tmp_path / "gen.jsonl"
    generate(build_config(GenerateConfig, {
        "model": "tiny", "data": [str(demo_files()["tools"])], "output": str(out), "max_prompts": 3,
        "num_samples": 2, "per_device_generation_batch_size": 3, "max_answer_seq_len": 80, "keep": "all",
        "progress": False, "tools": ["calculator"], "max_turns": 2}))
    rows, _ = read_jsonl_rows(out)
    assert len(rows) == 6
    assert all("<tool_response>42</tool_response>" in r["response"] and r["response"].endswith("</answer>")
               for r in rows)


def test_a_backend_that_samples_whole_answers_runs_episodes_turn_by_turn(tok):
    """generation.turns: each round's answers are cut at the row's first turn boundary (what was sampled after a
    call is dropped), the tool's result appended, the next round sampled from the longer prefix; the masks and
    texts are those of the decode loop's episodes."""
    from dschat.agents.episode import Episodes
    from dschat.generation.decode import Generated, GenerationConfig, Prompts
    from dschat.generation.turns import generate_by_turns

    eos, pad = tok.eos_token_id, tok.pad_token_id
    call = _ids(tok, " <tool_call>calculator(6*7)</tool_call>")
    junk = _ids(tok, " 999 made up")
    answer = _ids(tok, " <answer>42</answer>") + [eos]
    prompts = ["\n\nHuman: 6*7?\n\nAssistant:", "\n\nHuman: hi\n\nAssistant:"]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    seen: list[list[str]] = []

    def sample(p, m, config):  # a backend that writes whole answers: row 0 calls then answers, row 1 answers
        texts = [tok.decode(r[k.bool()]) for r, k in zip(p, m, strict=True)]
        seen.append(texts)
        outs = []
        for t in texts:
            if "6*7" in t and "<tool_response>" not in t:
                outs.append(call + junk + [eos])  # junk after the call: drawn without the result
            elif "6*7" in t:
                outs.append(answer)
            else:
                outs.append(_ids(tok, " hello") + [eos])
        width = max(len(o) for o in outs)
        rows = [o + [pad] * (width - len(o)) for o in outs]
        return Generated(torch.cat([p, torch.tensor(rows, dtype=p.dtype)], dim=1))

    ep = Episodes(_agent(), tok, [{}, {}], [eos], pad)
    out = generate_by_turns(sample, Prompts(enc.input_ids, enc.attention_mask, [eos], pad),
                            GenerationConfig(max_new_tokens=120), ep)
    P = enc.input_ids.shape[1]
    real, policy = out.real_mask, out.policy_mask
    row0 = out.sequences[0, P:][real[0]].tolist()
    assert tok.decode(row0) == tok.decode(call + _ids(tok, " <tool_response>42</tool_response>") + answer)
    assert out.sequences[0, P:][policy[0]].tolist() == call + answer  # the junk was dropped, the result is context
    assert tok.decode(out.sequences[1, P:][real[1]].tolist()) == tok.decode(_ids(tok, " hello") + [eos])
    assert len(seen) == 2 and len(seen[1]) == 1  # the second round samples only the row still going
    assert "<tool_response>42</tool_response>" in seen[1][0]
    assert ep.finished() == [True, True] and ep.state[0].counts.calls == 1


@pytest.mark.slow
def test_grpo_with_tools_on_hf_generate(tmp_path, tok):
    """--generation-backend hf with --tools: the episodes run turn by turn (an untrained model, two steps)."""
    from dschat.config import build_config
    from dschat.rlhf.config import RLHFConfig
    from tests.helpers import read_jsonl
    from tests.helpers import run_stage as run

    out = tmp_path / "hf"
    run(build_config(RLHFConfig, {
        "algo": "grpo", "actor_model": "tiny", "max_answer_seq_len": 16, "per_device_train_batch_size": 4,
        "output_dir": str(out), "max_steps": 2, "progress": False, "max_eval_rows": 2, "per_device_eval_batch_size": 2,
        "tools": ["calculator"], "num_generations": 2, "per_device_generation_batch_size": 2,
        "generation_backend": "hf", "reward_funcs": ["format"]}))
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "episode/turns" in r]
    assert len(rows) == 2 and all("train/actor_loss" in r for r in rows)


def test_data_inspect_shows_a_tool_trace_s_masks(tmp_path):
    """`dschat data inspect --phase 1` on a tool trace: the call and the answer trained, the tool's turn masked."""
    from click.testing import CliRunner

    from dschat.cli.data import data_inspect
    from dschat.utils import write_jsonl

    path = tmp_path / "trace.jsonl"
    write_jsonl([{"messages": TRACE}] * 4, path)
    result = CliRunner().invoke(data_inspect, ["--data", str(path), "--phase", "1", "--data-split", "1,0,0",
                                               "--num-samples", "1"])
    assert result.exit_code == 0, result.output
    lines = [line.strip() for line in result.output.splitlines()]
    assert any(line.startswith("masked") and "<tool_response>221</tool_response>" in line for line in lines)
    assert any(line.startswith("trained") and "calculator" in line for line in lines)
    assert any(line.startswith("trained") and "<answer>221</answer>" in line for line in lines)


def test_an_in_process_tool_runs_with_the_process_s_stdout_and_answers_with_its_return_value(capsys):
    """A function given as an object runs in the run's process: ``sys.stdout`` (every thread's) is never swapped
    for the call; its prints go to the run's output and its return value is its answer (None: empty)."""
    import sys

    seen = []

    def loud(text: str) -> str:
        """Echo.

        Args:
            text: what to echo.
        """
        seen.append(sys.stdout)
        print("printed by loud")
        return text.upper()

    def quiet(text: str) -> None:
        """Print only.

        Args:
            text: what to print.
        """
        print(text)

    runner = ToolRunner([tool_from_function(loud), tool_from_function(quiet)], max_output=100)
    stdout = sys.stdout
    assert runner.call("loud", {"text": "hi"}).wait().text == "HI"
    assert seen == [stdout] and sys.stdout is stdout
    result = runner.call("quiet", {"text": "to the run"}).wait()
    assert (result.text, result.error) == ("", None)
    assert capsys.readouterr().out == "printed by loud\nto the run\n"


def test_deeply_nested_arguments_are_a_malformed_call_not_a_crash():
    deep = json.dumps({"name": "f", "arguments": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(CallError, match="the call's arguments are not JSON"):
        parse_call(deep, {})
