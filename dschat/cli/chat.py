"""``dschat chat``: talk to a model, one answer (``--prompt``) or an interactive multi-turn session.

    dschat chat --model output/step3_rlhf/actor            # interactive: 'clear' resets, 'quit' / Ctrl-D ends
    dschat chat --model tiny --prompt "你好" --greedy       # one answer on stdout, nothing else there

The session itself (prompt fitting, stop strings, streaming) is ``dschat.generation.chat``.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import click

from dschat.config import BACKENDS
from dschat.devices import DTYPES, pick_device, resolve_dtype
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
@click.option("--generation-backend", "--generation_backend", "generation_backend", type=click.Choice(BACKENDS),
              default="auto", show_default=True,
              help="What samples: auto = vLLM on a GPU where it is installed, else HF generate; vllm, dschat, "
                   "compiled, hf. vLLM writes the answer when it is complete, not token by token.")
@click.option("--tools", multiple=True, help="A tool the model may call (repeatable): calculator or "
                                            "path/to/file.py:function; each call and its result are shown as they "
                                            "happen (docs/tools.md).")
@click.option("--env", multiple=True, help="An environment that answers the model's turns (repeatable: "
                                          "path/to/file.py:Class), its episode started from your message.")
@click.option("--max-turns", "--max_turns", "max_turns", type=click.IntRange(min=1), default=4, show_default=True,
              help="With --tools or --env: most assistant turns in one answer.")
@click.option("--tool-timeout", "--tool_timeout", "tool_timeout", type=click.FloatRange(min=0, min_open=True),
              default=10.0, show_default=True,
              help="With --tools or --env: seconds a tool call, or an environment's reset or step, may take.")
def chat_command(model: str, prompt: str | None, system: str | None, max_new_tokens: int, temperature: float,
                 top_p: float, top_k: int, greedy: bool, repetition_penalty: float, seed: int | None, device: str,
                 dtype: str, trust_remote_code: bool, generation_backend: str, tools: tuple[str, ...],
                 env: tuple[str, ...], max_turns: int, tool_timeout: float) -> None:
    """Chat with a model: interactively, or one answer with --prompt (clear resets, quit/exit/Ctrl-D ends)."""
    if prompt is not None and not prompt.strip():
        raise UserError("--prompt is empty")
    agent = None
    if tools or env:
        from dschat.agents.agent import build_agent
        from dschat.config import AgentArgs

        agent = build_agent(AgentArgs(tools=list(tools), env=list(env), max_turns=max_turns, tool_timeout=tool_timeout))
        if agent is not None:
            agent.warm()
    else:
        given = click.get_current_context().get_parameter_source
        for name, flag in (("max_turns", "--max-turns"), ("tool_timeout", "--tool-timeout")):
            if given(name) == click.core.ParameterSource.COMMANDLINE:
                raise UserError(f"{flag} has no effect without --tools or --env")
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
                  top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, log=log,
                  backend=generation_backend, agent=agent)

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
