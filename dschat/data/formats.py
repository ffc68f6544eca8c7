"""Row formats (docs/data.md, Row formats): detection per file, validation per row, and rendering to text.

A row is turned into an ``Example``: a prompt (text or chat messages) plus whatever answers it has. A missing
required field is a user error naming the file, line and field; an empty value only drops the row (counted).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dschat.agents.calls import CALL_CLOSE, CALL_OPEN, ArgumentsError, parse_arguments
from dschat.data.sources import WHERE
from dschat.errors import UserError
from dschat.prompts import ASSISTANT_SUFFIX, HUMAN_PREFIX, inject_system_prompt

PAIRWISE = "pairwise"
CONV_PAIRWISE = "conversational_pairwise"
SFT = "sft"
PROMPT_ONLY = "prompt_only"
JUDGE = "judge_pairwise"
FORMATS = (PAIRWISE, CONV_PAIRWISE, SFT, PROMPT_ONLY, JUDGE)

Messages = list[dict[str, str]]


@dataclass
class Example:
    """A normalised row. ``prompt`` is text or messages; answers are assistant texts (already split off)."""

    prompt: str | Messages
    chosen: str | None = None
    rejected: str | None = None
    answer: str | None = None  # ground truth for rule rewards / the judge's winner
    extra: dict[str, Any] = field(default_factory=dict)
    where: str = ""
    # A ``messages`` row: the assistant turns inside ``prompt`` are training targets too (stage 1), not context.
    train_all_turns: bool = False


class Dropped(Exception):
    """A row that is merely unusable: dropped and counted under ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _keys(row: dict[str, Any]) -> dict[str, str]:
    """Lower-cased key -> original key (Zhihu-KOL uses INSTRUCTION/RESPONSE)."""
    return {k.lower(): k for k in row if k != WHERE}


def detect_format(row: dict[str, Any]) -> str | None:
    k = _keys(row)
    if "context_messages" in k and "winner" in k:
        return JUDGE
    if "chosen" in k and "rejected" in k:
        return CONV_PAIRWISE if isinstance(row[k["chosen"]], list) or isinstance(row.get(k.get("prompt", "")),
                                                                                   list) else PAIRWISE
    if "messages" in k or ("prompt" in k and ("response" in k or "completion" in k)):
        return SFT
    if "instruction" in k and ("output" in k or "response" in k):
        return SFT
    if "prompt" in k or "question" in k:
        return PROMPT_ONLY
    return None


def source_format(rows: Sequence[dict[str, Any]], name: str) -> str:
    """The row format of a source, read from its first row; a source with no rows, or whose first row has none of
    the formats' fields, stops with one line naming the file and line."""
    if not rows:
        raise UserError(f"{name}: no rows")
    fmt = detect_format(rows[0])
    if fmt is None:
        raise UserError(f"{rows[0].get(WHERE, name)}: cannot tell the row format from its fields "
                        f"({describe_keys(rows[0])}); expected one of {', '.join(FORMATS)} "
                        "(docs/data.md, Row formats)")
    return fmt


def describe_keys(row: dict[str, Any]) -> str:
    return ", ".join(sorted(_keys(row).values())) or "(no fields)"


def _get(row: dict[str, Any], *names: str, required: bool = True) -> Any:
    k = _keys(row)
    for n in names:
        if n in k:
            return row[k[n]]
    if required:
        raise UserError(f"{row.get(WHERE, '?')}: missing field {names[0]!r} (has: {describe_keys(row)})")
    return None


def _text(row: dict[str, Any], value: Any, name: str) -> str:
    """A string field: None or blank drops the row; any other non-string is a user error."""
    if value is None:
        raise Dropped("empty")
    if not isinstance(value, str):
        raise UserError(f"{row.get(WHERE, '?')}: field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise Dropped("empty")
    return value


ROLES = ("system", "user", "assistant", "tool")
MAX_ARGUMENT_DEPTH = 32  # a tool call's arguments nested deeper than this are refused (they are rendered as JSON)


def _messages(row: dict[str, Any], value: Any, name: str) -> Messages:
    if value is None:
        raise Dropped("empty")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise UserError(f"{row.get(WHERE, '?')}: field {name!r} must be a list of {{role, content}} messages")
    out: Messages = []
    for i, m in enumerate(value):
        where = f"{row.get(WHERE, '?')}: field {name!r} message {i}"
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if "role" not in m or ("content" not in m and not calls):
            raise UserError(f"{where} needs 'role' and 'content'")
        _check_role(m, out, where)
        content = m.get("content")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise UserError(f"{where}: 'content' must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            msg["tool_calls"] = _tool_calls(calls, where)
        if m.get("role") == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    if not out or not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise Dropped("empty")
    return out


def _check_role(m: dict[str, Any], before: Messages, where: str) -> None:
    """A message's role is one the chat templates know, only an assistant message calls tools, and a ``tool``
    message answers a call: it follows an assistant message that made one (``tool_calls``, or a call written in
    its text), or another answer to it."""
    role = m["role"]
    if role == "function":
        raise UserError(f"{where}: role 'function' (the old OpenAI function result) is not supported: give it role "
                        "'tool', after an assistant message whose 'tool_calls' made the call")
    if role not in ROLES:
        raise UserError(f"{where}: unknown role {str(role)[:40]!r} (use one of {', '.join(ROLES)})")
    if m.get("tool_calls") and role != "assistant":
        raise UserError(f"{where}: 'tool_calls' on a {role!r} message (only assistant messages call tools)")
    if role == "tool":
        last = next((b for b in reversed(before) if b["role"] != "tool"), None)
        if last is None or last["role"] != "assistant" or not (last.get("tool_calls") or CALL_CLOSE in last["content"]):
            raise UserError(f"{where}: a 'tool' message must follow an assistant message that made a tool call "
                            f"('tool_calls', or {CALL_OPEN}...{CALL_CLOSE} in its text)")


def _depth(value: Any, limit: int) -> int:
    """How deeply lists and objects nest in ``value``, counted without recursion up to ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI/HF shape: ``{"type": "function", "function": {"name": ...,
    "arguments": {...} or a JSON string}}``, or the bare ``{"name", "arguments"}``), with the arguments as an
    object."""
    if not isinstance(calls, list):
        raise UserError(f"{where}: 'tool_calls' must be a list")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise UserError(f"{where}: tool call {j} needs a 'name' and 'arguments' (an object or a JSON string)")
        try:
            args = parse_arguments(f.get("arguments", {}))
        except ArgumentsError as e:
            says = {"json": f"is not valid JSON ({e.detail[:80]})", "depth": "nest too deeply",
                    "type": f"must be an object (or a JSON string of one), got {e.detail}"}[e.reason]
            raise UserError(f"{where}: tool call {j}: 'arguments' {says}") from None
        if _depth(args, MAX_ARGUMENT_DEPTH) > MAX_ARGUMENT_DEPTH:
            raise UserError(f"{where}: tool call {j}: 'arguments' nest deeper than {MAX_ARGUMENT_DEPTH} levels")
        out.append({"type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def _assistant_text(row: dict[str, Any], value: Any, name: str) -> str:
    """An answer given as a string, one assistant message, or a list ending with one."""
    if isinstance(value, str) or value is None:
        return _text(row, value, name)
    msgs = _messages(row, value, name)
    if msgs[-1]["role"] != "assistant":
        raise UserError(f"{row.get(WHERE, '?')}: field {name!r} must end with an assistant message")
    return _text(row, msgs[-1]["content"], name)


def split_hh_text(text: str) -> tuple[str, str] | None:
    """Anthropic/hh-rlhf stores the whole dialogue; the prompt ends at the last 'Assistant:'."""
    cut = text.rfind("\n\nAssistant:")
    if cut < 0:
        return None
    cut += len("\n\nAssistant:")
    return text[:cut], text[cut:]


# Each format's parser: the row, where it came from (``file:line``) and its fields beyond the format's own (kept
# on the example) -> an ``Example``; raises UserError (malformed) or Dropped (unusable). ``parse_row`` dispatches.
RowParser = Callable[[dict[str, Any], str, dict[str, Any]], Example]
PARSERS: dict[str, RowParser] = {}


def row_parser(fmt: str) -> Callable[[RowParser], RowParser]:
    def register(fn: RowParser) -> RowParser:
        PARSERS[fmt] = fn
        return fn

    return register


@row_parser(PAIRWISE)
def _pairwise(row: dict[str, Any], where: str, extra: dict[str, Any]) -> Example:
    chosen_raw, rejected_raw = _get(row, "chosen"), _get(row, "rejected")
    prompt = _get(row, "prompt", required=False)
    if prompt is None:  # hh-rlhf: the prompt is the shared dialogue before the last Assistant turn
        c, x = split_hh_text(_text(row, chosen_raw, "chosen")), split_hh_text(_text(row, rejected_raw, "rejected"))
        if c is None or x is None or c[0] != x[0]:
            raise UserError(f"{where}: missing field 'prompt' (and chosen/rejected are not "
                            "'Human:/Assistant:' dialogues sharing a prompt)")
        prompt, chosen, rejected = c[0], c[1], x[1]
    else:
        prompt = _text(row, prompt, "prompt")
        chosen, rejected = _text(row, chosen_raw, "chosen"), _text(row, rejected_raw, "rejected")
    if not chosen.strip() or not rejected.strip():
        raise Dropped("empty")
    return Example(prompt, chosen, rejected, extra=extra, where=where)


@row_parser(CONV_PAIRWISE)
def _conversational_pairwise(row: dict[str, Any], where: str, extra: dict[str, Any]) -> Example:
    prompt_raw = _get(row, "prompt", required=False)
    chosen_raw, rejected_raw = _get(row, "chosen"), _get(row, "rejected")
    if prompt_raw is not None:
        prompt_msgs = _messages(row, prompt_raw, "prompt") if not isinstance(prompt_raw, str) else \
            [{"role": "user", "content": _text(row, prompt_raw, "prompt")}]
        chosen = _assistant_text(row, chosen_raw, "chosen")
        rejected = _assistant_text(row, rejected_raw, "rejected")
        return Example(prompt_msgs, chosen, rejected, extra=extra, where=where)
    c, x = _messages(row, chosen_raw, "chosen"), _messages(row, rejected_raw, "rejected")
    n = 0
    while n < min(len(c), len(x)) - 1 and c[n] == x[n]:
        n += 1
    if n == 0 or c[:n] != x[:n] or c[-1]["role"] != "assistant" or x[-1]["role"] != "assistant":
        raise UserError(f"{where}: 'chosen' and 'rejected' must share the prompt messages and end with "
                        "an assistant message")
    if len(c) != n + 1 or len(x) != n + 1:
        raise UserError(f"{where}: 'chosen' and 'rejected' must differ only in their last assistant message")
    return Example(c[:n], _text(row, c[-1]["content"], "chosen"), _text(row, x[-1]["content"], "rejected"),
                   extra=extra, where=where)


def _prompt(row: dict[str, Any], raw: Any) -> str | Messages:
    """A ``prompt`` field: text, or chat messages."""
    return _text(row, raw, "prompt") if isinstance(raw, str) or raw is None else _messages(row, raw, "prompt")


@row_parser(SFT)
def _sft(row: dict[str, Any], where: str, extra: dict[str, Any]) -> Example:
    k = _keys(row)
    if "messages" in k:
        msgs = _messages(row, row[k["messages"]], "messages")
        if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise UserError(f"{where}: field 'messages' must hold a prompt and end with an assistant message")
        return Example(msgs[:-1], chosen=_text(row, msgs[-1]["content"], "messages"), extra=extra, where=where,
                       train_all_turns=True)
    if "instruction" in k:  # alpaca / Zhihu-KOL: a bare question, rendered with the chat template
        question = _text(row, row[k["instruction"]], k["instruction"])
        inp = row.get(k["input"]) if "input" in k else None
        if isinstance(inp, str) and inp.strip():
            question = f"{question}\n\n{inp}"
        response = _get(row, "output", "response")
        return Example([{"role": "user", "content": question}], chosen=_text(row, response, "output"),
                       extra=extra, where=where)
    prompt = _prompt(row, _get(row, "prompt"))
    response = _get(row, "response", "completion")
    return Example(prompt, chosen=_assistant_text(row, response, "response"), extra=extra, where=where)


@row_parser(PROMPT_ONLY)
def _prompt_only(row: dict[str, Any], where: str, extra: dict[str, Any]) -> Example:
    prompt = _prompt(row, _get(row, "prompt", "question"))
    answer = _get(row, "answer", "ground_truth", "solution", required=False)
    return Example(prompt, answer=None if answer is None else str(answer), extra=extra, where=where)


@row_parser(JUDGE)
def _judge_pairwise(row: dict[str, Any], where: str, extra: dict[str, Any]) -> Example:
    msgs = _messages(row, _get(row, "context_messages"), "context_messages")
    winner = _get(row, "winner")
    if winner not in ("model_a", "model_b"):
        raise UserError(f"{where}: field 'winner' must be 'model_a' or 'model_b', got {winner!r}")
    # An optional target judge completion (RM-R1's distilled reasoning) makes the row an SFT row for the cold start
    # too, so one file serves stage 1 and GRPO.
    response = _get(row, "response", "completion", required=False)
    chosen = None if response is None else _assistant_text(row, response, "response")
    return Example(msgs, chosen=chosen, answer=winner, extra=extra, where=where)


def parse_row(row: dict[str, Any], fmt: str) -> Example:
    """Validate one row of a file detected as ``fmt`` and normalise it. Raises UserError or Dropped."""
    if fmt not in PARSERS:
        raise ValueError(f"unknown format {fmt}")
    return PARSERS[fmt](row, str(row.get(WHERE, "?")), {k: v for k, v in row.items() if k != WHERE})


def parse_rows(rows: Sequence[dict[str, Any]], fmt: str, counts: Counter[str],
               judge_system: str | None = None) -> tuple[list[Example], list[str]]:
    """``parse_row`` over the rows of one source detected as ``fmt``, dropping and counting what it refuses
    (docs/data.md, Drops and the cache): an unusable row under ``dropped_<reason>``, a malformed one (a missing
    or mistyped field) under ``dropped_malformed``. Judge rows get ``judge_system`` as their rubric unless they
    have one.

    Returns the examples and the malformed rows' messages, for ``check_malformed``. Training, evaluation and
    ``dschat eval --judge`` all read rows through here, so they keep and drop the same rows.
    """
    out: list[Example] = []
    problems: list[str] = []
    for row in rows:
        try:
            ex = parse_row(row, fmt)
        except Dropped as d:
            counts[f"dropped_{d.reason}"] += 1
            continue
        except UserError as bad:
            counts["dropped_malformed"] += 1
            problems.append(str(bad))
            continue
        if fmt == JUDGE and judge_system:
            # The rubric goes first and the A/B answers stay where they are (positions are the label).
            ex.prompt = inject_system_prompt(ex.prompt, judge_system)  # type: ignore[arg-type]
        out.append(ex)
    return out, problems


def check_malformed(problems: list[str], seen: int, name: str, log: Callable[[str], None], scope: str = "") -> None:
    """Stop when most of the ``seen`` rows of source ``name`` were malformed (a wrong file or wrong field names,
    not a few bad rows); else log the first three messages. ``scope`` follows the source's name in the error
    (e.g. `` in this phase``)."""
    if not problems:
        return
    if 2 * len(problems) > seen:
        raise UserError(f"{problems[0]} ({len(problems)} of {seen} rows of {name}{scope} are malformed)")
    for text in problems[:3]:
        log(f"data: dropped a malformed row: {text}")
    if len(problems) > 3:
        log(f"data: ... and {len(problems) - 3} more malformed rows in {name}")


# ------------------------------------------------------------------------------------------------ rendering
HUMAN, ASSISTANT = HUMAN_PREFIX.rstrip(" "), ASSISTANT_SUFFIX


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(prompt: str | Messages, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> str:
    """Prompt text ending where the assistant's answer begins.

    Text prompts are used as given (rm-static style prompts already hold 'Human: ... Assistant:'). Messages use
    the tokenizer's chat template (given ``tools``, the function schemas of ``--tools``, where it renders them), or
    the plain Human/Assistant template when it has none: there a tool call is ``<tool_call>...</tool_call>`` in
    the assistant's turn and a tool's message `` <tool_response>...</tool_response>`` right after it, which the
    assistant continues without a new header (docs/tools.md, the plain format).
    """
    if isinstance(prompt, str):
        return prompt
    if has_chat_template(tokenizer):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **extra)
    return _plain_conversation(prompt) + ("" if prompt and prompt[-1]["role"] == "tool" else ASSISTANT)


def _plain_conversation(messages: Messages) -> str:
    """Messages in the Human/Assistant template, without the closing ``Assistant:`` of a generation prompt."""
    from dschat.agents.calls import render_call, render_result

    parts = []
    previous = None
    for m in messages:
        role = m["role"]
        if role == "system":
            parts.append(m["content"].strip() + "\n")
        elif role == "assistant":
            calls = "".join(render_call(c["function"]["name"], c["function"]["arguments"])
                            for c in m.get("tool_calls") or [])
            text = m["content"] + (" " + calls if calls and m["content"] else calls)
            parts.append(f" {text}" if previous == "tool" else f"{ASSISTANT} {text}")
        elif role == "tool":
            parts.append(render_result(m["content"]))
        else:
            parts.append(f"{HUMAN} {m['content']}")
        previous = role
    return "".join(parts)


def _render_conversation(messages: Messages, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> str:
    """Messages as the template writes a finished conversation (no generation prompt after it)."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, **({"tools": tools} if tools else {}))
    return _plain_conversation(messages)


@dataclass
class Span:
    """A piece of rendered text: ``trained`` for an assistant turn (its labels are its ids), else context
    (masked with -100). ``parts`` are the messages' own strings in it, tokenized as text."""

    text: str
    trained: bool
    parts: list[str | None]


def render_turns(prompt: str | Messages, tokenizer: Any,
                 tools: list[dict[str, Any]] | None = None) -> list[Span] | None:
    """``render_prompt(prompt)`` cut into spans, each assistant turn inside the prompt its own trained span (the
    multi-turn SFT of a ``messages`` row; the final answer follows, from ``render_answer``).

    An assistant turn's span is what the template writes for it after its generation prompt, end-of-turn marker
    included (``a1<|im_end|>\n`` in ChatML, `` a1`` in Human/Assistant); everything else (system and user turns,
    the template's headers) is context. None when there is no assistant turn to train in ``prompt`` (a leading
    assistant message is context: no template gives it a generation prompt), or when the template does not
    write a conversation as the prefix of its continuation (one that rewrites earlier turns, e.g. dropping
    their reasoning); then only the final answer is trained.
    """
    if isinstance(prompt, str):
        return None
    spans: list[Span] = []
    done, start = "", 0  # text already in spans; first message not yet in them
    for i, m in enumerate(prompt):
        if m["role"] != "assistant" or i == 0:
            continue
        head = render_prompt(prompt[:i], tokenizer, tools)
        full = _render_conversation(prompt[: i + 1], tokenizer, tools)
        if not (head.startswith(done) and full.startswith(head)):
            return None
        spans.append(Span(head[len(done):], False, [x["content"] for x in prompt[start:i]]))
        spans.append(Span(full[len(head):], True, [m["content"]]))
        done, start = full, i + 1
    head = render_prompt(prompt, tokenizer, tools)
    if not spans or not head.startswith(done):
        return None
    spans.append(Span(head[len(done):], False, [x["content"] for x in prompt[start:]]))
    return spans


def render_answer(prompt: str | Messages, answer: str, tokenizer: Any,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The answer text that follows ``render_prompt(prompt)``, in the same template."""
    if isinstance(prompt, str):
        return answer
    if has_chat_template(tokenizer):
        head = render_prompt(prompt, tokenizer, tools)
        full = _render_conversation(prompt + [{"role": "assistant", "content": answer}], tokenizer, tools)
        if full.startswith(head):
            # The template's own end-of-turn marker stays in the answer; the EOS token is appended later.
            tail = full[len(head):]
            eos = getattr(tokenizer, "eos_token", None)
            if eos and tail.rstrip().endswith(eos):
                tail = tail.rstrip()[: -len(eos)]
            return tail
        return answer
    return answer if answer.startswith((" ", "\n")) else " " + answer
