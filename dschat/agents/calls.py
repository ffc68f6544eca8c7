"""How a tool call and the turns that answer it look in the text, and how a call is parsed.

A call is what the policy writes between ``<tool_call>`` and ``</tool_call>`` (the markers Hermes-style chat
templates use: Qwen2.5, Qwen3, Hermes):

- a JSON object ``{"name": "calculator", "arguments": {"expression": "13*17"}}`` (``arguments`` may also be a
  JSON string holding that object), or
- the short form ``calculator(13*17)``, for a tool with one required parameter: the text between the
  parentheses is that parameter's value.

What answers a call, and an environment's observation, are *turns* (``TurnText``): with a chat template that renders
tool messages (``tools`` in its source), the template's own rendering of a ``tool`` (or ``user``) message after
the assistant's, up to the next assistant turn; otherwise the plain format, `` <tool_response>RESULT</tool_response>``
after the call and ``\\n\\nHuman: OBSERVATION\\n\\nAssistant:`` (the rm-static turn) after an answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dschat.prompts import ASSISTANT_SUFFIX, HUMAN_PREFIX

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_SHORT = re.compile(r"^([A-Za-z_][\w.-]*)\((.*)\)$", re.S)
_A, _R = "\x00A\x00", "\x00R\x00"  # placeholders whose rendering is cut out of a template's text


class CallError(ValueError):
    """A call that cannot be parsed: the reason, one line (it goes back to the policy as the error turn)."""


class ArgumentsError(CallError):
    """A call's arguments that are no object: ``reason`` says why (``json``: not JSON, ``detail`` the parser's
    message; ``depth``: nested too deeply to parse; ``type``: not an object, ``detail`` its type's name), so each
    reader words it for its own audience (the policy's error turn, a data row's error)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"arguments: {reason}{': ' + detail if detail else ''}")
        self.reason, self.detail = reason, detail


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """A call in the plain format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{CALL_CLOSE}"


def render_result(text: str) -> str:
    """A tool's result in the plain format, as it follows the call."""
    return f" {RESPONSE_OPEN}{text}{RESPONSE_CLOSE}"


def open_call(text: str) -> str | None:
    """The body of the call ``text`` has just closed (it ends with ``</tool_call>``), else None."""
    if not text.endswith(CALL_CLOSE):
        return None
    start = text.rfind(CALL_OPEN)
    return text[start + len(CALL_OPEN): -len(CALL_CLOSE)] if start >= 0 else ""


def parse_arguments(args: Any) -> dict[str, Any]:
    """A call's arguments as an object: an object as it is, a JSON string holding one parsed (a blank string: no
    arguments); anything else raises ``ArgumentsError``. The one reading of arguments, for the calls a policy
    writes (``parse_call``) and for the ``tool_calls`` of a data row's messages (``dschat.data.formats``)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise ArgumentsError("json", str(e)) from None
        except RecursionError:
            raise ArgumentsError("depth") from None
    if not isinstance(args, dict):
        raise ArgumentsError("type", type(args).__name__)
    return args


def parse_call(body: str, one_parameter: dict[str, str]) -> Call:
    """The call in ``body`` (what stood between the markers); ``one_parameter`` maps each tool that has a single
    required parameter to its name (the short form's target)."""
    body = body.strip()
    if not body:
        raise CallError("an empty call")
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise CallError(f"the call is not JSON ({str(e).splitlines()[0][:80]})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise CallError('the call must be {"name": ..., "arguments": {...}}')
        try:
            args = parse_arguments(obj.get("arguments", obj.get("parameters", {})))
        except ArgumentsError as e:
            raise CallError("the call's arguments must be an object" if e.reason == "type"
                            else "the call's arguments are not JSON") from None
        return Call(obj["name"], args)
    m = _SHORT.match(body)
    if not m:
        raise CallError('a call is {"name": ..., "arguments": {...}} or name(argument)')
    name, text = m.group(1), m.group(2).strip()
    if name not in one_parameter:
        raise CallError(f"{name}(...) is the short form, for a tool with one parameter; use JSON")
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1]
    return Call(name, {one_parameter[name]: text})


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tool lists and tool messages."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and "tool" in template


class TurnText:
    """The text of the turns an episode appends: a tool's result after a call, an observation after an answer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.template = renders_tools(tokenizer)
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_text = eos if isinstance(eos, str) else ""

    def _between(self, role: str) -> tuple[str, str]:
        """The template's text after an assistant message and around a following ``role`` message, up to the
        next assistant turn's start: ``(before, after)`` the message's content."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _A},
                    {"role": role, "content": _R}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        tail = text.split(_A, 1)[1]
        before, after = tail.split(_R, 1)
        return before, after

    def tool_result(self, text: str) -> str:
        """What follows ``</tool_call>``: the result's turn, then the assistant's turn again."""
        if not self.template:
            return render_result(text)
        before, after = self._between("tool")
        return before + text + after

    def observation(self, text: str) -> str:
        """What follows the assistant's finished turn (its EOS already generated): the environment's message as
        the user's turn, then the assistant's turn again."""
        if not self.template:
            return f"{HUMAN_PREFIX}{text}{ASSISTANT_SUFFIX}"
        before, after = self._between("user")
        before = before.lstrip()
        if self.eos_text and before.startswith(self.eos_text):  # the turn's end the policy already wrote
            before = before[len(self.eos_text):]
        return before + text + after
