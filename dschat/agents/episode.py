"""Episodes: a batch of rows sampled with tools and environments, each row advancing on its own.

``Agent`` (``dschat.agents.agent``) is a run's set-up (its tools, environments and limits); ``Episodes`` drives one
batch of episodes inside the decode loop (``dschat.generation.decode``), token by token. At each step the loop samples a
token for every row and hands it to ``Episodes.advance``, which decides, per row:

- **sample**: the policy's token stands (a *policy* token: it gets loss, KL and, for PPO, values). When it closes
  a call (``</tool_call>``) the call is parsed and started (``ToolRunner``); when it is EOS the turn ends, and an
  environment answers it (``step``) or the episode is over;
- **force**: the token is replaced by the next token of a tool's result or an environment's observation (a
  *context* token: fed through the model, so the cache holds it, but never trained on);
- **wait**: the row's tool is still running; the row feeds a masked padding column (not attended to, its position
  not advanced) while the other rows go on; when every unfinished row waits, the loop waits for the first tool;
- **done**: padding.

The cache of each row's prefix is kept throughout: nothing is recomputed when a turn is appended. The policy mask
``(B, A)`` and the real-token mask ``(B, A)`` come back with the sequences; ``rollout.make_rollout`` turns them into
the action mask (policy tokens only) and the attention mask (every real token). Each row's text for the reward
functions is its whole continuation (calls, results, observations and answers), special tokens dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dschat.agents.agent import Agent
from dschat.agents.calls import CALL_OPEN, CallError, Turns, open_call, parse_call
from dschat.agents.env import as_step
from dschat.agents.tools import ToolCall
from dschat.errors import first_line

SAMPLE, FORCE, WAIT, DONE = range(4)


@dataclass
class _Row:
    mode: int = SAMPLE
    turn: list[int] = field(default_factory=list)  # the policy's tokens of the current turn
    forced: deque[int] = field(default_factory=deque)
    call: ToolCall | None = None
    turns: int = 0
    calls: int = 0
    errors: int = 0
    malformed: int = 0
    env: Any = None
    env_reward: float = 0.0
    finished: bool = False  # ended by the policy's EOS or the environment (not by a budget)


@dataclass
class EpisodeInfo:
    """What a batch of episodes produced besides its tokens, one entry per row: the text of each whole
    continuation (the reward functions read it), its length in tokens (policy and context), the environment reward
    (None without an environment), and the counts of turns, calls and errors."""

    texts: list[str]
    lengths: list[int]
    env_rewards: list[float | None]
    turns: list[int]
    calls: list[int]
    errors: list[int]

    def select(self, idx: Any) -> EpisodeInfo:
        rows = [int(i) for i in (idx.tolist() if hasattr(idx, "tolist") else idx)]
        return EpisodeInfo(*([getattr(self, f)[i] for i in rows] for f in self.__dataclass_fields__))

    @staticmethod
    def concat(parts: list[EpisodeInfo]) -> EpisodeInfo:
        return EpisodeInfo(*([x for p in parts for x in getattr(p, f)] for f in EpisodeInfo.__dataclass_fields__))



class Episodes:
    """One batch of episodes (rows in the order of the prompts), driven by the decode loop: ``start`` before the
    first token, ``advance`` at every token, ``info`` after the last."""

    def __init__(self, agent: Agent, tokenizer: Any, rows: list[dict[str, Any]], eos_ids: list[int],
                 pad_token_id: int):
        self.agent, self.tokenizer, self.rows = agent, tokenizer, rows
        self.eos = set(eos_ids)
        self.pad = pad_token_id
        self.turns = Turns(tokenizer)
        self.state = [_Row() for _ in rows]
        self.one_parameter = {t.name: t.required[0] for t in agent.tools if len(t.required) == 1}
        # called as things happen: (row, kind, text), kind one of turn (the policy's finished turn), call (a call's
        # body), result (a tool's answer), observation (an environment's); ``dschat chat`` shows them
        self.on_event: Any = None
        self.may_close = agent.may_close(tokenizer)
        self.errors = {"env": 0}

    # ------------------------------------------------------------------------------------------- set-up
    def _env_of(self, row: dict[str, Any]) -> type | None:
        envs = self.agent.envs
        if not envs:
            return None
        if len(envs) == 1:
            return next(iter(envs.values()))
        name = row.get(self.agent.env_column)
        if name not in envs:
            from dschat.errors import UserError

            raise UserError(f"data column {self.agent.env_column!r}: {name!r} names no --env "
                            f"(environments: {', '.join(envs)})")
        return envs[name]

    def start(self) -> None:
        """Start every row's environment; an observation it gives opens the row's answer as context."""
        for row, st in zip(self.rows, self.state, strict=True):
            cls = self._env_of(row)
            if cls is None:
                continue
            try:
                st.env = cls()
                first = st.env.reset(dict(row))
            except Exception as e:  # noqa: BLE001 - the user's environment: the episode ends, counted
                self._env_failed(st, f"reset raised {type(e).__name__}: {first_line(e, 120)}")
                continue
            if first:
                st.forced.extend(self._ids(str(first)))
                st.mode = FORCE

    def _ids(self, text: str) -> list[int]:
        """A turn's ids, encoded on its own: as SFT encodes each turn of a conversation (``data.phases``,
        multi-turn SFT), so the tokens an episode feeds are those its SFT traces taught."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _env_failed(self, st: _Row, why: str) -> None:
        st.errors += 1
        self.errors["env"] += 1
        st.mode, st.finished = DONE, False
        if not getattr(self.agent, "_said_env", False):
            print(f"[episodes] environment error (the episode ends; counted in episode/tool_errors): {why}",
                  flush=True)
            self.agent._said_env = True  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------- per token
    def advance(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens ``(B,)`` after each row's say, with ``real`` (fed and attended to), ``policy`` (the
        policy's own token) and ``done`` flags, each ``(B,)`` bool on ``sampled``'s device."""
        dev = sampled.device
        toks = sampled.tolist()
        B = len(toks)
        real, policy, done = [True] * B, [False] * B, [False] * B
        waiting = [i for i, st in enumerate(self.state) if st.mode == WAIT]
        if waiting and all(st.mode in (WAIT, DONE) for st in self.state):
            self.state[waiting[0]].call.wait()  # every unfinished row waits: wait for the first tool
        for i in range(B):
            toks[i], real[i], policy[i], done[i] = self.step_row(i, toks[i])
        t = torch.tensor
        return (t(toks, device=dev), t(real, device=dev), t(policy, device=dev), t(done, device=dev))

    def step_row(self, i: int, tok: int, block: bool = False) -> tuple[int, bool, bool, bool]:
        """Row ``i``'s say on its sampled ``tok``: ``(token, real, policy, done)``. ``block``: a row whose tool is
        still running waits for it instead of feeding a masked column."""
        st = self.state[i]
        if st.mode == WAIT:
            assert st.call is not None
            if not block and not st.call.done():
                return self.pad, False, False, False
            result = st.call.wait()
            st.errors += result.error is not None
            self._event(i, "result", result.text)
            st.call = None
            st.forced.extend(self._ids(self.turns.tool_result(result.text)))
            st.mode = FORCE if st.forced else SAMPLE
        if st.mode == FORCE:
            tok = st.forced.popleft()
            if not st.forced:
                st.mode = SAMPLE
            return tok, True, False, False
        if st.mode == DONE:
            return self.pad, False, False, True
        st.turn.append(tok)
        if tok in self.eos:
            self._end_turn(i, st)
        elif tok in self.may_close:
            turn = self.tokenizer.decode(st.turn, skip_special_tokens=False)
            body = open_call(turn)
            if body is not None:
                self._event(i, "turn", turn[: turn.rfind(CALL_OPEN)])
                self._event(i, "call", body)
                self._call(st, body)
        return tok, True, True, st.mode == DONE

    def sampling(self, i: int) -> bool:
        """Whether row ``i``'s next token is the policy's (not a tool's result, an observation or its end)."""
        return self.state[i].mode == SAMPLE

    def _call(self, st: _Row, body: str) -> None:
        st.turns += 1
        st.turn = []
        if st.turns >= self.agent.max_turns:  # the last turn allowed: the call is not run, the episode is cut
            st.mode = DONE
            return
        st.calls += 1
        try:
            call = parse_call(body, self.one_parameter)
        except CallError as e:
            st.malformed += 1
            st.call = self.agent.runner.error("malformed", str(e))
        else:
            st.call = self.agent.runner.call(call.name, call.arguments)
        st.mode = WAIT

    def _event(self, row: int, kind: str, text: str) -> None:
        if self.on_event is not None:
            self.on_event(row, kind, text)

    def _end_turn(self, i: int, st: _Row) -> None:
        st.turns += 1
        text = self.tokenizer.decode(st.turn, skip_special_tokens=True)
        st.turn = []
        self._event(i, "turn", text)
        if st.env is None:
            st.mode, st.finished = DONE, True
            return
        try:
            step = as_step(st.env.step(text), "environment")
        except Exception as e:  # noqa: BLE001 - the user's environment: the episode ends, counted
            self._env_failed(st, f"step raised {type(e).__name__}: {first_line(e, 120)}")
            return
        st.env_reward += step.reward
        if step.done:
            st.mode, st.finished = DONE, True
        elif st.turns >= self.agent.max_turns:
            st.mode = DONE  # cut: the environment had more to say
        elif step.observation:
            self._event(i, "observation", step.observation)
            st.forced.extend(self._ids(self.turns.observation(step.observation)))
            st.mode = FORCE

    # ------------------------------------------------------------------------------------------- results
    def finished(self) -> list[bool]:
        return [st.finished for st in self.state]

    def info(self, answers: torch.Tensor, real: torch.Tensor) -> EpisodeInfo:
        """The batch's ``EpisodeInfo`` from the answer columns ``(B, A)`` and their real-token mask."""
        texts = self.tokenizer.batch_decode([row[m] for row, m in zip(answers.cpu(), real.bool().cpu(), strict=True)],
                                            skip_special_tokens=True)
        return EpisodeInfo(texts, real.sum(-1).tolist(),
                           [st.env_reward if st.env is not None or self.agent.envs else None for st in self.state],
                           [st.turns for st in self.state], [st.calls for st in self.state],
                           [st.errors for st in self.state])
