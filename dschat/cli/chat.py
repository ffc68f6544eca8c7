"""``dschat chat``: talk to a model, one answer (``--prompt``) or an interactive multi-turn session.

    dschat chat --model output/step3_rlhf/actor            # interactive: 'clear' resets, 'quit' / Ctrl-D ends
    dschat chat --model tiny --prompt "你好" --greedy       # one answer on stdout, nothing else there

The session itself (prompt fitting, stop strings, streaming) is ``dschat.generation.chat``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, TextIO

import click

from dschat.cli.options import DeclaredFlagsCommand, declared_config, given_flags, refuse_given
from dschat.config import AgentArgs, ModelArgs, backend_help, piece
from dschat.devices import pick_device, resolve_dtype
from dschat.errors import UserError
from dschat.prompts import Messages

CLEAR_WORDS = ("clear", "/clear")
QUIT_WORDS = ("quit", "exit", "/quit", "/exit")
USER_PROMPT = "user> "
ASSISTANT_PREFIX = "assistant> "


# -------------------------------------------------------------------------------------------------- loops
def interactive(bot: Any, system: str | None, out: TextIO, banner: str) -> None:
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


# auto's fallback in chat: HF generate (it reads the model's own generation config), dschat's loop for an episode
BACKEND_HELP = (backend_help("hf (dschat's loop with --tools or --env)")
                + " vLLM writes the answer when it is complete, not token by token.")


@functools.cache
def chat_flags() -> type:
    """``ChatFlags``: the flags ``dschat chat`` shares with the commands that sample, from their declarations (made
    when the command parses its arguments or shows its help: stage 3's pieces are imported then). Chat keeps its
    own sampling defaults (temperature 0.7, top-p 0.9), and its ``auto`` falls back to HF generate."""
    from dschat.rlhf.config import RLArgs

    return dataclasses.make_dataclass("ChatFlags", [
        ("model", ModelArgs, piece(ModelArgs, only=("dtype", "trust_remote_code"))),
        ("rl", RLArgs, piece(RLArgs, only=("temperature", "top_p", "top_k", "generation_backend"),
                             defaults={"temperature": 0.7, "top_p": 0.9}, help={"generation_backend": BACKEND_HELP})),
        ("agent", AgentArgs, dataclasses.field(default_factory=AgentArgs)),
    ])


# What --greedy leaves without effect: it always takes the likeliest token.
GREEDY_INERT = {n: "with --greedy" for n in ("temperature", "top_p", "top_k", "seed")}


@click.command("chat", cls=DeclaredFlagsCommand, flags=chat_flags, context_settings={"max_content_width": 110})
@click.option("--model", required=True,
              help="Model: a folder (a stage output folder stands for its actor/ or model/), an HF id in the "
                   "cache, an alias or the preset 'tiny'.")
@click.option("--prompt", default=None, help="Answer this one message, print the answer to stdout and exit.")
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--max-new-tokens", "--max_new_tokens", "max_new_tokens", type=click.IntRange(min=1), default=256,
              show_default=True, help="Longest answer in tokens.")
@click.option("--greedy", is_flag=True, help="Always take the likeliest token (--temperature, --top-p, --top-k and "
                                             "--seed then have no effect).")
@click.option("--repetition-penalty", "--repetition_penalty", "repetition_penalty",
              type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Divide the logits of already generated tokens by this (1 = off).")
@click.option("--seed", type=int, default=None, help="Seed the sampler, so the same flags give the same answers.")
@click.option("--device", default="auto", show_default=True,
              help="auto = CUDA when available, else CPU; or e.g. cpu, cuda, cuda:1.")
def chat_command(model: str, prompt: str | None, system: str | None, max_new_tokens: int, greedy: bool,
                 repetition_penalty: float, seed: int | None, device: str, **declared: Any) -> None:
    """Chat with a model: interactively, or one answer with --prompt (clear resets, quit/exit/Ctrl-D ends)."""
    given = given_flags()
    if declared.get("temperature") == 0:  # the other tools' spelling of greedy decoding
        raise UserError("--temperature must be > 0; for greedy decoding pass --greedy")
    cfg = declared_config(chat_flags(), declared, given)
    if greedy:
        refuse_given(given, GREEDY_INERT)
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty")
    agent = None
    if cfg.agent.tools or cfg.agent.env:
        from dschat.agents.agent import build_agent

        agent = build_agent(cfg.agent)
        if agent is not None:
            agent.warm()
    # torch and transformers: see the module docstring
    import torch
    import transformers

    from dschat.generation.chat import Chatbot
    from dschat.models.loading import create_causal_lm, load_tokenizer, resolve_saved_model

    path = resolve_saved_model(model)
    dev = pick_device(device)

    transformers.utils.logging.disable_progress_bar()  # keep the terminal for the conversation

    def log(text: str) -> None:
        click.echo(text, err=True)

    torch_dtype = resolve_dtype(cfg.model.dtype, dev)
    if torch_dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("--dtype bf16: this GPU does not support bfloat16; use fp16")
    tokenizer = load_tokenizer(path, cfg.model.trust_remote_code)
    try:
        lm = create_causal_lm(path, torch_dtype, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot load a causal LM ({str(e).strip().splitlines()[0][:200]})") from None
    lm.to(dev).eval()
    if seed is not None:
        from transformers import set_seed

        set_seed(seed)
    r = cfg.rl
    bot = Chatbot(lm, tokenizer, dev, max_new_tokens=max_new_tokens, greedy=greedy, temperature=r.temperature,
                  top_p=r.top_p, top_k=r.top_k, repetition_penalty=repetition_penalty, log=log,
                  backend=r.generation_backend, agent=agent)

    out = sys.stdout
    if prompt is not None:
        messages: Messages = ([{"role": "system", "content": system}] if system else [])
        bot.reply(messages + [{"role": "user", "content": prompt}], lambda t: (out.write(t), out.flush()))
        out.write("\n")
        out.flush()
        return
    mode = "greedy" if greedy else "sampling"
    interactive(bot, system, out, f"dschat chat: {path} on {dev} ({str(torch_dtype).removeprefix('torch.')}, "
                                  f"{mode}); 'clear' starts over, 'quit' or Ctrl-D ends.")
