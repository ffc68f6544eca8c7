"""Chat sessions: a conversation as ``{role, content}`` messages, fitted to the model's positions, answered with
streaming (``dschat chat``).

The conversation is rendered by ``render_prompt``, the function the stages train with: the tokenizer's chat
template when it has one, else the plain ``\\n\\nHuman: ...\\n\\nAssistant:`` format. A plain-format model may go on
to write the next ``\\n\\nHuman:`` turn itself; generation stops there and that text is never shown. When the
conversation outgrows the model's positions the oldest turns are dropped.

Only transformers is used (no DeepSpeed engine): one process, one device. torch and transformers are imported
when a chat starts, so ``dschat --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dschat.errors import UserError
from dschat.prompts import Messages

STOP_WINDOW_TOKENS = 32


# ------------------------------------------------------------------------------------------ prompt building
def encode_prompt(messages: Messages, tokenizer: Any) -> list[int]:
    """Token ids of the rendered conversation, ending where the assistant's answer begins.

    Special tokens are added as the stages add them (a leading BOS), unless the chat template already wrote
    the BOS text itself: a doubled BOS is a sequence the model never saw.
    """
    from dschat.data.formats import render_prompt  # torch: imported when a chat starts
    from dschat.data.usertext import encode_one, prompt_parts

    text = render_prompt(messages, tokenizer)
    bos = getattr(tokenizer, "bos_token", None)
    special = not (bos and text.startswith(bos))
    return encode_one(tokenizer, text, prompt_parts(messages), special)  # the user's "</s>" is text, not EOS


def _turn_starts(messages: Messages) -> list[int]:
    """Indices of the user messages that start a turn (a turn: one user message and the answers after it)."""
    return [i for i, m in enumerate(messages) if m["role"] == "user"]


def fit_messages(messages: Messages, tokenizer: Any, budget: int | None) -> tuple[Messages, list[int], int, bool]:
    """Drop the oldest turns until the rendered prompt has at most ``budget`` tokens.

    Leading system messages are kept, and so is the last turn: if it alone is too long its tokens are cut from
    the left (keeping a leading BOS), so the end of the question and the assistant marker survive. Returns the
    kept messages, their token ids, the number of turns dropped and whether the ids were cut.
    """
    ids = encode_prompt(messages, tokenizer)
    if budget is None or len(ids) <= budget:
        return messages, ids, 0, False
    dropped = 0
    starts = _turn_starts(messages)
    head = messages[: starts[0]] if starts else []
    while len(starts) > 1 and len(ids) > budget:
        messages = head + messages[starts[1]:]
        dropped += 1
        starts = _turn_starts(messages)
        ids = encode_prompt(messages, tokenizer)
    if len(ids) <= budget:
        return messages, ids, dropped, False
    from dschat.data.usertext import keep_end  # torch: imported when a chat starts

    return messages, keep_end(ids, budget, getattr(tokenizer, "bos_token_id", None)), dropped, True


def stop_strings(tokenizer: Any) -> list[str]:
    """Text that ends an answer besides EOS: the plain format's next turn markers (a chat template ends turns
    with its own special tokens, which generation already stops at)."""
    from dschat.data.formats import ASSISTANT, HUMAN, has_chat_template  # torch: imported when a chat starts

    return [] if has_chat_template(tokenizer) else [HUMAN, ASSISTANT]


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string (so must not be shown yet)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


# ---------------------------------------------------------------------------------------------- generation
def _make_streamer(tokenizer: Any, stops: list[str], write: Callable[[str], None]) -> Any:
    """A ``TextStreamer`` (prompt and special tokens skipped) that writes through ``write``, never shows a stop
    string or anything after it, nor the whitespace around an answer."""
    from transformers import TextStreamer

    class ChatStreamer(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.text = ""  # everything finalised so far
            self.shown = 0  # characters of self.text already written
            self.stopped = False

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if self.stopped:
                return
            self.text += text
            visible, self.stopped = cut_at_stop(self.text, stops)
            if not (self.stopped or stream_end):
                visible = visible[: len(visible) - held_back(visible, stops)]
            # Trailing whitespace waits for the next word, and an answer's last whitespace is never shown: the
            # streamed text is then exactly the answer ``reply`` returns.
            visible = visible.rstrip()
            if self.shown == 0:
                # Skip leading whitespace: keep `shown` at 0 until the answer's first visible character.
                lead = len(visible) - len(visible.lstrip())
                self.text, visible = self.text[lead:], visible[lead:]
            if len(visible) > self.shown:
                write(visible[self.shown:])
                self.shown = len(visible)

    return ChatStreamer()


class Chatbot:
    """A loaded model plus the sampling settings: ``reply(messages)`` streams one answer and returns it."""

    def __init__(self, model: Any, tokenizer: Any, device: Any, *, max_new_tokens: int, greedy: bool,
                 temperature: float, top_p: float, top_k: int, repetition_penalty: float,
                 log: Callable[[str], None], backend: str = "auto", agent: Any = None):
        from dschat.models.loading import max_positions  # torch: imported when a chat starts

        self.model, self.tokenizer, self.device, self.log = model, tokenizer, device, log
        self.max_new_tokens = max_new_tokens
        self.stops = stop_strings(tokenizer)
        limit = max_positions(model.config, tokenizer)
        self.budget = None if limit is None else limit - max_new_tokens
        if self.budget is not None and self.budget < 1:
            raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: the model takes "
                            f"{limit} positions in all")
        from dschat.generation.backends import make_backend
        from dschat.generation.decode import GenerationConfig

        sample = not greedy and temperature > 0
        self.generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature,
                                           top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty)
        # auto: vLLM on a GPU, else the captured step on a GPU, else HF's generate, which reads the rest of the
        # model's own generation config. EOS ids come from that config either way (end of turn and end of text,
        # where a chat model lists both).
        # with tools or an environment (``agent``), dschat's own loop: the episodes run inside it
        self.agent = agent
        self.backend = make_backend(backend, model, fallback="dschat" if agent is not None else "hf")
        own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = own if own is not None else tokenizer.eos_token_id

    def reply(self, messages: Messages, write: Callable[[str], None]) -> tuple[str, Messages]:
        """Generate the assistant's answer to ``messages`` (streamed through ``write``).

        Returns the answer and the messages it answered: fewer than given when the oldest turns were dropped to
        fit the model's positions, so the caller can keep its history within bounds too.
        """
        import torch

        from dschat.generation.backends import generate
        from dschat.generation.decode import Prompts

        kept, ids, dropped, cut = fit_messages(messages, self.tokenizer, self.budget)
        if dropped:
            self.log(f"(dropped the {dropped} oldest turn(s) to fit the model's positions)")
        if cut:
            self.log(f"(message cut to its last {len(ids)} tokens to fit the model's positions)")
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        prompts = Prompts(input_ids, torch.ones_like(input_ids), self.eos_token_id, self.tokenizer.pad_token_id)
        if self.agent is not None:
            return self._episode(kept, prompts, write), kept
        streamer = _make_streamer(self.tokenizer, self.stops, write)
        streamer.put(input_ids.cpu())  # the prompt, which the streamer skips
        stops = StopStrings(self.tokenizer, self.stops)

        def on_token(tok: torch.Tensor, policy: torch.Tensor) -> bool:
            streamer.put(tok.cpu())
            return stops(tok, policy)

        with torch.inference_mode():
            out = generate(self.backend, self.model, prompts, self.generation, on_token=on_token)
        streamer.end()
        text = self.tokenizer.decode(out.sequences[0, len(ids):], skip_special_tokens=True)
        return cut_at_stop(text, self.stops)[0].strip(), kept

    def _episode(self, messages: Messages, prompts: Any, write: Callable[[str], None]) -> str:
        """One episode with the chat's tools or environment, on whichever backend samples (token by token in
        dschat's loop, turn by turn on HF's generate or vLLM): each turn of the assistant, each call and each
        result or observation written as it happens, and the episode stopped where the assistant writes a stop
        string. Returns the episode's whole text (a stop string and what follows it cut from its last turn)."""
        import torch

        from dschat.agents.episode import Episodes
        from dschat.generation.backends import generate

        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        episodes = Episodes(self.agent, self.tokenizer, [{"prompt": prompt}], eos, self.tokenizer.pad_token_id)
        shown = {"turn": "", "call": "\n  [call] ", "result": "\n  [result] ", "observation": "\n  [observation] "}
        stops = StopStrings(self.tokenizer, self.stops)

        def show(row: int, kind: str, text: str) -> None:
            text = text.strip()
            if text or kind != "turn":
                write(shown[kind] + text + ("\n" if kind in ("result", "observation") else ""))

        episodes.on_event = show
        with torch.inference_mode():
            out = generate(self.backend, self.model, prompts, self.generation, episodes=episodes, on_token=stops)
        assert out.real_mask is not None and out.policy_mask is not None
        P = prompts.ids.shape[1]
        real, policy = out.real_mask[0].bool(), out.policy_mask[0].bool()
        answer = out.sequences[0, P:][real]
        if not stops.stopped:
            return self.tokenizer.decode(answer, skip_special_tokens=True).strip()
        own = policy[real]  # the last run of the policy's own tokens is the turn the stop string ended
        start = len(own) - int(torch.flip(~own, [0]).int().argmax()) if (~own).any() else 0
        head = self.tokenizer.decode(answer[:start], skip_special_tokens=True)
        last = cut_at_stop(self.tokenizer.decode(answer[start:], skip_special_tokens=True), self.stops)[0]
        write(last.strip())
        return (head + last).strip()


class StopStrings:
    """The ``on_token`` hook that stops an answer at a stop string: only the policy's own tokens are read (a tool's
    result or an observation is not the assistant's text), and only a tail of them is decoded (a stop string is a
    few characters, so a few tokens even as byte pieces)."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tail: list[int] = []
        self.stopped = False

    def __call__(self, tok: Any, policy: Any) -> bool:
        if not bool(policy[0]):
            self.tail = []  # a turn of the policy's ends where something else is fed
            return False
        self.tail = (self.tail + [int(tok[0])])[-STOP_WINDOW_TOKENS:]
        if self.stops:
            text = self.tokenizer.decode(self.tail, skip_special_tokens=True)
            self.stopped = cut_at_stop(text, self.stops)[1]
        return self.stopped
