"""Episodes: a batch of rows sampled with tools and environments, each row advancing on its own.

``Agent`` (``dschat.agents.agent``) is a run's set-up (its tools, environments and limits); ``Episodes`` drives one
batch of episodes inside the decode loop (``dschat.generation.decode``), token by token. At each step the loop samples a
token for every row and hands it to ``Episodes.advance``, which decides, per row:

- **sample**: the policy's token stands (a *policy* token: it gets loss, KL and, for PPO, values). When it closes
  a call (``</tool_call>``) the call is parsed and started (``ToolRunner``); when it is EOS the turn ends, and an
  environment answers it (``step``) or the episode is over;
- **force**: the token is replaced by the next token of a tool's result or an environment's observation (a
  *context* token: fed through the model, so the cache holds it, but never trained on);
- **wait**: the row's tool (or its environment's ``step``) is still running; the row feeds a masked padding
  column (not attended to, its position not advanced) while the other rows go on; when every unfinished row waits,
  the loop waits for the first;
- **done**: padding.

The cache of each row's prefix is kept throughout: nothing is recomputed when a turn is appended. The policy mask
``(B, A)`` and the real-token mask ``(B, A)`` come back with the sequences; ``rollout.make_rollout`` turns them into
the action mask (policy tokens only) and the attention mask (every real token). Each row's text for the reward
functions is its whole continuation (calls, results, observations and answers), special tokens dropped.
"""

from __future__ import annotations

import enum
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from dschat.agents.agent import Agent, EpisodeCounts
from dschat.agents.calls import CALL_OPEN, CallError, TurnText, open_call, parse_call
from dschat.agents.env import EnvCall, EnvReply
from dschat.agents.tools import ToolCall, ToolResult


class Mode(enum.Enum):
    """What a row does with the next column (the module docstring says each)."""

    SAMPLE = "sample"
    FORCE = "force"
    WAIT = "wait"
    DONE = "done"


@dataclass
class _Row:
    mode: Mode = Mode.SAMPLE
    turn: list[int] = field(default_factory=list)  # the policy's tokens of the current turn
    forced: deque[int] = field(default_factory=deque)
    call: ToolCall | EnvCall | None = None  # a tool's call, or the environment's step, in flight
    counts: EpisodeCounts = field(default_factory=lambda: EpisodeCounts(episodes=1))  # this row's episode
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
    first token, ``advance`` at every token, ``info`` and ``counts`` after the last. (On a backend that samples
    whole answers, ``dschat.generation.turns`` drives the same rows through ``step_row`` and ``sampling``.)"""

    host_every_token = True  # each row's say is decided on the host, at every token

    def __init__(self, agent: Agent, tokenizer: Any, rows: list[dict[str, Any]], eos_ids: list[int],
                 pad_token_id: int):
        self.agent, self.tokenizer, self.rows = agent, tokenizer, rows
        self.eos = set(eos_ids)
        self.pad = pad_token_id
        self.text = TurnText(tokenizer)
        self.state = [_Row() for _ in rows]
        self.one_parameter = {t.name: t.required[0] for t in agent.tools if len(t.required) == 1}
        # called as things happen: (row, kind, text), kind one of turn (the policy's finished turn), call (a call's
        # body), result (a tool's answer), observation (an environment's); ``dschat chat`` shows them
        self.on_event: Any = None
        self.may_close = agent.may_close(tokenizer)
        self._adopted: tuple[list[bool], EpisodeInfo, EpisodeCounts] | None = None  # results run elsewhere
        self._sessions: list[Any] = []  # each row's environment, closed when its episode ends or this batch goes
        weakref.finalize(self, _close_all, self._sessions)

    # ------------------------------------------------------------------------------------------- set-up
    def start(self) -> None:
        """Start every row's environment (the resets run side by side, each under the deadline, and this waits for
        them all); an observation one gives opens the row's answer as context."""
        started = []
        for row, st in zip(self.rows, self.state, strict=True):
            name = self.agent.env_name(row)
            if name is None:
                continue
            st.env = self.agent.open_env(name)
            self._sessions.append(st.env)
            started.append((st, st.env.reset(dict(row))))
        for st, call in started:
            reply = call.wait()
            if reply.error is not None:
                self._env_failed(st, reply)
            elif reply.observation:
                self._count_truncated(st, reply)
                st.forced.extend(self._ids(reply.observation))
                st.mode = Mode.FORCE

    def _ids(self, text: str) -> list[int]:
        """A turn's ids, encoded on its own: as SFT encodes each turn of a conversation (``data.phases``,
        multi-turn SFT), so the tokens an episode feeds are those its SFT traces taught."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _env_failed(self, st: _Row, reply: EnvReply) -> None:
        st.counts.errors += 1
        st.counts.kinds[f"env_{reply.error}"] += 1
        self._end(st, False)
        if not self.agent.said_env_error:
            print(f"[episodes] environment error (the episode ends; counted in episode/tool_errors): {reply.message}",
                  flush=True)
            self.agent.said_env_error = True

    def _count_truncated(self, st: _Row, reply: EnvReply) -> None:
        st.counts.kinds["env_truncated"] += reply.truncated

    def _tool_result(self, st: _Row, result: ToolResult) -> None:
        """A tool's result reaches the row: counted by kind."""
        st.counts.errors += result.error is not None
        if result.error is not None:
            st.counts.kinds[f"tool_{result.error}"] += 1
        st.counts.kinds["tool_truncated"] += result.truncated

    def _end(self, st: _Row, finished: bool) -> None:
        """The row's episode is over (``finished``: by itself, not cut); its environment is let go."""
        st.mode, st.finished = Mode.DONE, finished
        if st.env is not None:
            st.env.close()

    # ------------------------------------------------------------------------------------------- per token
    def advance(self, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens ``(B,)`` after each row's say, with ``real`` (fed and attended to), ``policy`` (the
        policy's own token) and ``done`` flags, each ``(B,)`` bool on ``sampled``'s device."""
        dev = sampled.device
        toks = sampled.tolist()
        B = len(toks)
        real, policy, done = [True] * B, [False] * B, [False] * B
        waiting = [i for i, st in enumerate(self.state) if st.mode is Mode.WAIT]
        if waiting and all(st.mode in (Mode.WAIT, Mode.DONE) for st in self.state):
            self.state[waiting[0]].call.wait()  # every unfinished row waits: wait for the first tool
        for i in range(B):
            toks[i], real[i], policy[i], done[i] = self.step_row(i, toks[i])
        t = torch.tensor
        return (t(toks, device=dev), t(real, device=dev), t(policy, device=dev), t(done, device=dev))

    def step_row(self, i: int, tok: int, block: bool = False) -> tuple[int, bool, bool, bool]:
        """Row ``i``'s say on its sampled ``tok``: ``(token, real, policy, done)``. ``block``: a row whose tool is
        still running waits for it instead of feeding a masked column."""
        st = self.state[i]
        if st.mode is Mode.WAIT:
            assert st.call is not None
            if not block and not st.call.done():
                return self.pad, False, False, False
            call, st.call = st.call, None
            if isinstance(call, EnvCall):
                st.mode = Mode.SAMPLE
                self._stepped(i, st, call.wait())
                if st.mode is not Mode.FORCE:  # over, or the policy's turn again: this column stays masked
                    return self.pad, False, False, st.mode is Mode.DONE
            else:
                result = call.wait()
                self._tool_result(st, result)
                self._event(i, "result", result.text)
                st.forced.extend(self._ids(self.text.tool_result(result.text)))
                st.mode = Mode.FORCE if st.forced else Mode.SAMPLE
        if st.mode is Mode.FORCE:
            tok = st.forced.popleft()
            if not st.forced:
                st.mode = Mode.SAMPLE
            return tok, True, False, False
        if st.mode is Mode.DONE:
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
        return tok, True, True, st.mode is Mode.DONE

    def sampling(self, i: int) -> bool:
        """Whether row ``i``'s next token is the policy's (not a tool's result, an observation or its end)."""
        return self.state[i].mode is Mode.SAMPLE

    def _call(self, st: _Row, body: str) -> None:
        st.counts.turns += 1
        st.turn = []
        if st.counts.turns >= self.agent.max_turns:  # the last turn allowed: the call is not run, the episode is cut
            self._end(st, False)
            return
        st.counts.calls += 1
        try:
            call = parse_call(body, self.one_parameter)
        except CallError as e:
            st.call = self.agent.runner.error("malformed", str(e))
        else:
            st.call = self.agent.runner.call(call.name, call.arguments)
        st.mode = Mode.WAIT

    def _event(self, row: int, kind: str, text: str) -> None:
        if self.on_event is not None:
            self.on_event(row, kind, text)

    def _end_turn(self, i: int, st: _Row) -> None:
        st.counts.turns += 1
        text = self.tokenizer.decode(st.turn, skip_special_tokens=True)
        st.turn = []
        self._event(i, "turn", text)
        if st.env is None:
            self._end(st, True)
            return
        call = st.env.step(text)
        if call.done():  # an environment in this process: answered already
            self._stepped(i, st, call.wait())
        else:
            st.call, st.mode = call, Mode.WAIT

    def _stepped(self, i: int, st: _Row, reply: EnvReply) -> None:
        """The environment's answer to row ``i``'s finished turn."""
        if reply.error is not None:
            self._env_failed(st, reply)
            return
        self._count_truncated(st, reply)
        st.env_reward += reply.reward
        if reply.done:
            self._end(st, True)
        elif st.counts.turns >= self.agent.max_turns:
            self._end(st, False)  # cut: the environment had more to say
        elif reply.observation:
            self._event(i, "observation", reply.observation)
            st.forced.extend(self._ids(self.text.observation(reply.observation)))
            st.mode = Mode.FORCE

    # ------------------------------------------------------------------------------------------- results
    def adopt(self, record: dict[str, Any]) -> None:
        """Take the results of these very episodes run elsewhere (a sampler process: ``sampler.episode_record``):
        ``finished``, ``info`` and ``counts`` answer from ``record`` from now on."""
        counts = record["counts"]
        self._adopted = (list(record["finished"]), EpisodeInfo(**record["info"]),
                         EpisodeCounts(**{**counts, "kinds": Counter(counts["kinds"])}))

    def finished(self) -> list[bool]:
        if self._adopted is not None:
            return self._adopted[0]
        return [st.finished for st in self.state]

    def info(self, answers: torch.Tensor, real: torch.Tensor) -> EpisodeInfo:
        """The batch's ``EpisodeInfo`` from the answer columns ``(B, A)`` and their real-token mask."""
        if self._adopted is not None:
            return self._adopted[1]
        texts = self.tokenizer.batch_decode([row[m] for row, m in zip(answers.cpu(), real.bool().cpu(), strict=True)],
                                            skip_special_tokens=True)
        return EpisodeInfo(texts, real.sum(-1).tolist(),
                           [st.env_reward if st.env is not None or self.agent.envs else None for st in self.state],
                           [st.counts.turns for st in self.state], [st.counts.calls for st in self.state],
                           [st.counts.errors for st in self.state])

    def counts(self, real: torch.Tensor, policy: torch.Tensor) -> EpisodeCounts:
        """The batch's counts (every row's, and its policy and context tokens from the masks ``(B, A)``)."""
        if self._adopted is not None:
            return self._adopted[2]
        total = EpisodeCounts()
        for st in self.state:
            total += st.counts
        total.policy_tokens = int(policy.sum())
        total.context_tokens = int(real.sum()) - total.policy_tokens
        return total


def _close_all(sessions: list[Any]) -> None:
    for session in sessions:
        session.close()
