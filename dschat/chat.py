"""``dschat chat``: talk to a model, one answer (``--prompt``) or an interactive multi-turn session.

    dschat chat --model output/step3_rlhf/actor            # interactive: 'clear' resets, 'quit' / Ctrl-D ends
    dschat chat --model tiny --prompt "你好" --greedy       # one answer on stdout, nothing else there

The conversation is kept as ``{role, content}`` messages and rendered by ``render_prompt``, the function the
stages train with: the tokenizer's chat template when it has one, else the plain ``\\n\\nHuman: ...\\n\\nAssistant:``
format. A plain-format model may go on to write the next ``\\n\\nHuman:`` turn itself; generation stops there and
that text is never shown. When the conversation outgrows the model's positions the oldest turns are dropped.

Only transformers is used (no DeepSpeed engine): one process, one device. Registered on the ``dschat`` group by
``dschat.cli``; torch and transformers are imported when the command runs (``dschat --help`` stays fast).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any, TextIO

import click

from dschat.devices import DTYPES, pick_device, resolve_dtype
from dschat.errors import UserError
from dschat.prompts import Messages

CLEAR_WORDS = ("clear", "/clear")
QUIT_WORDS = ("quit", "exit", "/quit", "/exit")
USER_PROMPT = "user> "
ASSISTANT_PREFIX = "assistant> "
STOP_WINDOW_TOKENS = 32


# ------------------------------------------------------------------------------------------ prompt building
def encode_prompt(messages: Messages, tokenizer: Any) -> list[int]:
    """Token ids of the rendered conversation, ending where the assistant's answer begins.

    Special tokens are added as the stages add them (a leading BOS), unless the chat template already wrote
    the BOS text itself: a doubled BOS is a sequence the model never saw.
    """
    from dschat.data.formats import render_prompt  # torch: see the module docstring
    from dschat.usertext import encode_one, prompt_parts

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
    bos = getattr(tokenizer, "bos_token_id", None)
    keep_bos = [bos] if bos is not None and ids and ids[0] == bos else []
    return messages, keep_bos + ids[len(ids) - (budget - len(keep_bos)):], dropped, True


def stop_strings(tokenizer: Any) -> list[str]:
    """Text that ends an answer besides EOS: the plain format's next turn markers (a chat template ends turns
    with its own special tokens, which generation already stops at)."""
    from dschat.data.formats import ASSISTANT, HUMAN, has_chat_template  # torch: see the module docstring

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


def _stop_criteria(tokenizer: Any, stops: list[str], prompt_len: int) -> Any:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopOnText(StoppingCriteria):
        """True once the answer's last tokens hold a stop string (batch size 1). Only a tail is decoded (a stop
        string is a few characters, so a few tokens even as byte pieces), keeping each step's check cheap."""

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            import torch

            start = max(prompt_len, input_ids.shape[1] - STOP_WINDOW_TOKENS)
            text = tokenizer.decode(input_ids[0, start:], skip_special_tokens=True)
            hit = cut_at_stop(text, stops)[1]
            return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopOnText()]) if stops else None


class Chatbot:
    """A loaded model plus the sampling settings: ``reply(messages)`` streams one answer and returns it."""

    def __init__(self, model: Any, tokenizer: Any, device: Any, *, max_new_tokens: int, greedy: bool,
                 temperature: float, top_p: float, top_k: int, repetition_penalty: float,
                 log: Callable[[str], None]):
        from dschat.models import max_positions  # torch: see the module docstring

        self.model, self.tokenizer, self.device, self.log = model, tokenizer, device, log
        self.max_new_tokens = max_new_tokens
        self.stops = stop_strings(tokenizer)
        limit = max_positions(model.config, tokenizer)
        self.budget = None if limit is None else limit - max_new_tokens
        if self.budget is not None and self.budget < 1:
            raise UserError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: the model takes "
                            f"{limit} positions in all")
        self.generation_config = self._generation_config(greedy, temperature, top_p, top_k, repetition_penalty)

    def _generation_config(self, greedy: bool, temperature: float, top_p: float, top_k: int,
                           repetition_penalty: float) -> Any:
        from transformers import GenerationConfig

        # Start from the model's own config: it may list several EOS ids (end of turn and end of text).
        base = getattr(self.model, "generation_config", None)
        cfg = copy.deepcopy(base) if base is not None else GenerationConfig()
        sample = not greedy and temperature > 0
        cfg.do_sample = sample
        # Greedy decoding ignores the sampling knobs; neutral values keep transformers from warning about them.
        cfg.temperature = temperature if sample else 1.0
        cfg.top_p = top_p if sample else 1.0
        cfg.top_k = top_k if sample else 0
        cfg.repetition_penalty = repetition_penalty
        cfg.max_new_tokens = self.max_new_tokens
        cfg.max_length = None
        cfg.pad_token_id = self.tokenizer.pad_token_id
        if cfg.eos_token_id is None:
            cfg.eos_token_id = self.tokenizer.eos_token_id
        return cfg

    def reply(self, messages: Messages, write: Callable[[str], None]) -> tuple[str, Messages]:
        """Generate the assistant's answer to ``messages`` (streamed through ``write``).

        Returns the answer and the messages it answered: fewer than given when the oldest turns were dropped to
        fit the model's positions, so the caller can keep its history within bounds too.
        """
        import torch

        kept, ids, dropped, cut = fit_messages(messages, self.tokenizer, self.budget)
        if dropped:
            self.log(f"(dropped the {dropped} oldest turn(s) to fit the model's positions)")
        if cut:
            self.log(f"(message cut to its last {len(ids)} tokens to fit the model's positions)")
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        streamer = _make_streamer(self.tokenizer, self.stops, write)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=self.generation_config, streamer=streamer,
                                      stopping_criteria=_stop_criteria(self.tokenizer, self.stops, len(ids)))
        text = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        return cut_at_stop(text, self.stops)[0].strip(), kept


# -------------------------------------------------------------------------------------------------- loops
def interactive(bot: Chatbot, system: str | None, out: TextIO, banner: str) -> None:
    """Read a line, answer it, repeat; ``clear`` forgets the conversation, ``quit``/``exit``/EOF ends."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    base: Messages = [{"role": "system", "content": system}] if system else []
    messages = list(base)

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    write(banner + "\n")
    while True:
        try:
            line = input(USER_PROMPT)
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        text = line.strip()
        if not text:
            continue
        if text.lower() in QUIT_WORDS:
            return
        if text.lower() in CLEAR_WORDS:
            messages = list(base)
            write("(conversation cleared)\n")
            continue
        write(ASSISTANT_PREFIX)
        try:
            answer, kept = bot.reply(messages + [{"role": "user", "content": text}], write)
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the session; the question is forgotten
            write("\n(interrupted)\n")
            continue
        write("\n")
        messages = kept + [{"role": "assistant", "content": answer}]


@click.command("chat")
@click.option("--model", required=True,
              help="Model: a folder (a stage output folder stands for its actor/ or model/), an HF id in the "
                   "cache, an alias or the preset 'tiny'.")
@click.option("--prompt", default=None, help="Answer this one message, print the answer to stdout and exit.")
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--max-new-tokens", "--max_new_tokens", "max_new_tokens", type=click.IntRange(min=1), default=256,
              show_default=True, help="Longest answer in tokens.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.7, show_default=True,
              help="Sampling temperature (0 = greedy).")
@click.option("--top-p", "--top_p", "top_p", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True, help="Nucleus sampling: keep the smallest set of tokens with this much mass.")
@click.option("--top-k", "--top_k", "top_k", type=click.IntRange(min=0), default=0, show_default=True,
              help="Sample among the k likeliest tokens (0 = no limit).")
@click.option("--greedy", is_flag=True, help="Always take the likeliest token (ignores the sampling flags).")
@click.option("--repetition-penalty", "--repetition_penalty", "repetition_penalty",
              type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Divide the logits of already generated tokens by this (1 = off).")
@click.option("--seed", type=int, default=None, help="Seed the sampler, so the same flags give the same answers.")
@click.option("--device", default="auto", show_default=True,
              help="auto = CUDA when available, else CPU; or e.g. cpu, cuda, cuda:1.")
@click.option("--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
              help="auto = bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on CPU.")
@click.option("--trust-remote-code/--no-trust-remote-code", default=False, show_default=True)
def chat_command(model: str, prompt: str | None, system: str | None, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int, greedy: bool, repetition_penalty: float, seed: int | None, device: str,
                 dtype: str, trust_remote_code: bool) -> None:
    """Chat with a model: interactively, or one answer with --prompt (clear resets, quit/exit/Ctrl-D ends)."""
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty")
    # torch and transformers: see the module docstring
    import torch
    import transformers

    from dschat.models import create_causal_lm, load_tokenizer, resolve_saved_model

    path = resolve_saved_model(model)
    dev = pick_device(device)

    transformers.utils.logging.disable_progress_bar()  # keep the terminal for the conversation

    def log(text: str) -> None:
        click.echo(text, err=True)

    torch_dtype = resolve_dtype(dtype, dev)
    if torch_dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bf16: this GPU does not support bfloat16; use fp16")
    tokenizer = load_tokenizer(path, trust_remote_code)
    try:
        lm = create_causal_lm(path, torch_dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot load a causal LM ({str(e).strip().splitlines()[0][:200]})") from None
    lm.to(dev).eval()
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
    bot = Chatbot(lm, tokenizer, dev, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature,
                  top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, log=log)

    out = sys.stdout
    if prompt is not None:
        messages: Messages = ([{"role": "system", "content": system}] if system else [])
        bot.reply(messages + [{"role": "user", "content": prompt}], lambda t: (out.write(t), out.flush()))
        out.write("\n")
        out.flush()
        return
    mode = "sampling" if not greedy and temperature > 0 else "greedy"
    interactive(bot, system, out, f"dschat chat: {path} on {dev} ({str(torch_dtype).removeprefix('torch.')}, "
                                  f"{mode}); 'clear' starts over, 'quit' or Ctrl-D ends.")
