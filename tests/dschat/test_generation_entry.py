"""The one entry into generation (``dschat.generation.backends.generate``): episodes run wherever the backend lets
them (token by token in dschat's loop, turn by turn over whole answers), with the repetition penalty, the
``on_token`` hook and the chat's stop strings holding inside an episode; a backend with its own weights synced once
per call; ``dschat chat --tools`` on every backend."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dschat.agents.agent import Agent
from dschat.agents.episode import Episodes
from dschat.agents.tools import ToolRunner, load_tools
from dschat.generation.backends import generate
from dschat.generation.decode import (
    Capabilities,
    DschatBackend,
    Generated,
    GenerationConfig,
    HFBackend,
    Prompts,
    SharesWeights,
)
from tests.dschat.scripted import Again, script_policy


@pytest.fixture(scope="module")
def tok() -> Any:
    from dschat.models.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny"))


@pytest.fixture(scope="module")
def model() -> Any:
    from transformers import AutoModelForCausalLM

    from dschat.models.loading import resolve_model

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny")).eval()


def _ids(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _prompts(tok: Any, end: int) -> Prompts:
    enc = tok(["\n\nHuman: where is my parcel?\n\nAssistant:", "\n\nHuman: hi\n\nAssistant:"], return_tensors="pt",
              padding=True, padding_side="left")
    return Prompts(enc.input_ids, enc.attention_mask, [end], tok.pad_token_id)


def _turn_end(model: Any, tok: Any) -> int:
    """The token the untrained model writes most, taken as the turn's end so its episodes have several turns."""
    p = _prompts(tok, tok.eos_token_id)
    out = HFBackend().generate(model, p.ids, p.mask, GenerationConfig(max_new_tokens=24, do_sample=False),
                               tok.eos_token_id, tok.pad_token_id)
    return Counter(out.sequences[:, p.ids.shape[1]:].flatten().tolist()).most_common(1)[0][0]


def _env_episodes(tok: Any, end: int) -> Episodes:
    agent = Agent([], ToolRunner([]), {"Again": Again}, "env", 4)
    return Episodes(agent, tok, [{}, {}], [end], tok.pad_token_id)


def _kept(out: Generated, P: int) -> list[list[int]]:
    assert out.real_mask is not None
    return [row[P:][real].tolist() for row, real in zip(out.sequences, out.real_mask.bool(), strict=True)]


def test_repetition_penalty_holds_in_episodes_token_by_token_and_turn_by_turn(model, tok):
    """Greedy episodes with an environment: dschat's loop (token by token) and HF generate (turn by turn, the
    penalty over each round's whole prefix) give the same tokens and masks with a repetition penalty, so the
    loop's penalty counts the observations it fed; and the penalty changed the episodes."""
    end = _turn_end(model, tok)
    p = _prompts(tok, end)
    P = p.ids.shape[1]
    runs = {}
    for name, backend, penalty in (("loop", DschatBackend(), 1.3), ("turns", HFBackend(), 1.3),
                                   ("plain", DschatBackend(), 1.0)):
        eps = _env_episodes(tok, end)
        out = generate(backend, model, p, GenerationConfig(max_new_tokens=40, do_sample=False,
                                                           repetition_penalty=penalty), episodes=eps)
        runs[name] = (out, eps)
    loop, turns = runs["loop"], runs["turns"]
    assert _kept(loop[0], P) == _kept(turns[0], P)
    assert [r[loop[0].real_mask[i]].tolist() for i, r in enumerate(loop[0].policy_mask)] == \
        [r[turns[0].real_mask[i]].tolist() for i, r in enumerate(turns[0].policy_mask)]
    assert [st.counts.turns for st in loop[1].state] == [st.counts.turns for st in turns[1].state]
    out = loop[0]
    context = out.real_mask & ~out.policy_mask
    after = [bool(c.any()) and bool(pol[int(c.int().argmax()):].any()) for c, pol in zip(context, out.policy_mask,
                                                                                          strict=True)]
    assert any(after)  # an observation was fed, and the policy sampled after it (under the penalty of its tokens)
    assert _kept(loop[0], P) != _kept(runs["plain"][0], P)  # the penalty did something


def test_on_token_sees_every_column_of_an_episode_and_stops_it(model, tok):
    """In an episode the hook sees each column's tokens and which are the policy's (an observation is not);
    returning True ends every row there."""
    end = _turn_end(model, tok)
    p = _prompts(tok, end)
    seen: list[tuple[list[int], list[bool]]] = []

    def hook(tokens: torch.Tensor, policy: torch.Tensor) -> bool:
        seen.append((tokens.tolist(), policy.tolist()))
        return False

    out = generate(DschatBackend(), model, p, GenerationConfig(max_new_tokens=40, do_sample=False),
                   episodes=_env_episodes(tok, end), on_token=hook)
    A = out.sequences.shape[1] - p.ids.shape[1]
    assert len(seen) == A
    assert torch.equal(torch.tensor([s[0] for s in seen]).T, out.sequences[:, p.ids.shape[1]:])
    assert torch.equal(torch.tensor([s[1] for s in seen]).T, out.policy_mask)
    assert not out.policy_mask.all()  # observations were fed, and the hook was told they are not the policy's
    stop_at = 5
    seen.clear()
    out = generate(DschatBackend(), model, p, GenerationConfig(max_new_tokens=40, do_sample=False),
                   episodes=_env_episodes(tok, end), on_token=lambda t, pol: seen.append(t) or len(seen) == stop_at)
    assert out.sequences.shape[1] - p.ids.shape[1] == stop_at


class _Owned(SharesWeights):
    """A whole-answer backend with its own copy of the weights: counts its syncs and releases."""

    name = "owned"
    caps = Capabilities(token_by_token=False, logprobs=False, engine_logprobs=False, owns_weights=True)

    def __init__(self, inner: HFBackend):
        super().__init__()
        self.inner, self.calls = inner, Counter()

    def sync(self, module: Any, engine: Any = None, batch: int = 1, total: int = 64) -> dict[str, float]:
        self.calls["sync"] += 1
        return {}

    def release(self) -> None:
        self.calls["release"] += 1

    def generate(self, module: Any, prompt: torch.Tensor, prompt_mask: torch.Tensor, config: GenerationConfig,
                 eos_token_id: Any, pad_token_id: int, *, on_token: Any = None, rows: Any = None) -> Generated:
        assert rows is None
        self.calls["generate"] += 1
        return self.inner.generate(module, prompt, prompt_mask, config, eos_token_id, pad_token_id,
                                   on_token=on_token)


def test_a_backend_with_its_own_weights_syncs_once_per_call_whatever_the_rounds(model, tok):
    """The entry, not the caller, syncs: once before a call and one release after, even when its episodes take
    several rounds of whole answers."""
    end = _turn_end(model, tok)
    backend = _Owned(HFBackend())
    generate(backend, model, _prompts(tok, end), GenerationConfig(max_new_tokens=40, do_sample=False),
             episodes=_env_episodes(tok, end))
    assert backend.calls["generate"] >= 2 and (backend.calls["sync"], backend.calls["release"]) == (1, 1)


def scripted(monkeypatch: Any, tok: Any, script: list[int]) -> None:
    """The policy writes ``script`` then EOS in every row, on any backend, for this test."""
    from dschat.agents import episode as EP

    monkeypatch.setattr(EP.Episodes, "step_row", EP.Episodes.step_row)  # restored after the test
    script_policy(lambda row: script)


def _bot(model: Any, tok: Any, backend: str) -> Any:
    from dschat.generation.chat import Chatbot

    tools = load_tools(["calculator"])
    agent = Agent(tools, ToolRunner(tools, 5.0, 200), {}, "env", 4)
    return Chatbot(model, tok, torch.device("cpu"), max_new_tokens=80, greedy=True, temperature=0.0, top_p=1.0,
                   top_k=0, repetition_penalty=1.0, log=lambda _: None, backend=backend, agent=agent)


@pytest.mark.parametrize("backend", ["dschat", "hf"])
def test_chat_with_tools_on_every_backend(model, tok, monkeypatch, backend):
    """``dschat chat --tools calculator`` on the token loop and on HF generate (turn by turn): the call and its
    result shown as they happen, the answer after the result."""
    scripted(monkeypatch, tok, _ids(tok, " <tool_call>calculator(6*7)</tool_call>") + _ids(tok, " <answer>42</answer>"))
    bot = _bot(model, tok, backend)
    assert bot.backend.name == backend
    shown: list[str] = []
    answer, _ = bot.reply([{"role": "user", "content": "6 times 7?"}], shown.append)
    text = "".join(shown)
    assert "[call] calculator(6*7)" in text and "[result] 42" in text and text.rstrip().endswith("<answer>42</answer>")
    assert answer.endswith("<answer>42</answer>") and "<tool_response>42</tool_response>" in answer


@pytest.mark.parametrize("backend", ["dschat", "hf"])
def test_chat_with_tools_stops_at_a_stop_string(model, tok, monkeypatch, backend):
    """A plain-format model that goes on to write the user's next turn: the episode stops at the stop string, which
    is neither shown nor kept, on either driver."""
    scripted(monkeypatch, tok, _ids(tok, " <tool_call>calculator(6*7)</tool_call>")
             + _ids(tok, " <answer>42</answer>\n\nHuman: and now? more text here"))
    bot = _bot(model, tok, backend)
    assert bot.stops  # the tiny tokenizer has no chat template: the plain format's turn markers stop an answer
    shown: list[str] = []
    answer, _ = bot.reply([{"role": "user", "content": "6 times 7?"}], shown.append)
    assert answer.endswith("<answer>42</answer>") and "Human:" not in answer
    assert "Human:" not in "".join(shown) and "".join(shown).rstrip().endswith("<answer>42</answer>")
