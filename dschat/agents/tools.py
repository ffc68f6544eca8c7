"""Tools: Python functions the policy calls during an episode (``--tools``), and the runner that calls them.

A tool is a function whose signature and docstring are its schema (``tool_from_function``): the first paragraph
of the docstring describes it, an ``Args:`` section describes its parameters, and the annotations give their JSON
types. ``--tools calculator`` names a built-in; ``--tools path/to/file.py:function`` loads a user's function.

``ToolRunner`` calls a tool in a thread of its own under ``--tool-timeout`` and caps what comes back (its return
value, or what it printed when it returns None) at ``--tool-max-output`` characters. A tool that raises, hangs,
prints or returns junk, and a call that cannot be parsed, become an error message in the episode
(``ToolResult.error`` says which kind), never a crashed run. A Python thread cannot be killed: a tool past its
timeout is abandoned and its thread runs on in the background until it returns.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import math
import operator
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dschat.errors import UserError, first_line
from dschat.userfiles import load_object, split_label

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of an object
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF function schema, what a chat template's ``tools=`` takes."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """A docstring's first paragraph and its ``Args:`` entries (Google style)."""
    doc = inspect.cleandoc(doc or "")
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    block = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.M)
    if block:
        name = None
        for line in block.group(1).splitlines():
            m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if m and (name is None or len(line) - len(line.lstrip()) <= 4):
                name, args[m.group(1)] = m.group(1), m.group(2).strip()
            elif name is not None:
                args[name] = f"{args[name]} {line.strip()}".strip()
    return description, args


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """The tool of ``fn``: its name, its docstring's first paragraph, and a parameter per argument (a type from
    its annotation, a description from the docstring's ``Args:``, required unless it has a default)."""
    description, docs = _doc_parts(fn.__doc__ or "")
    props: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation
        if isinstance(ann, str):  # from __future__ import annotations
            ann = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(ann, ann)
        entry: dict[str, Any] = {"type": JSON_TYPES.get(ann, "string")}
        if p.name in docs:
            entry["description"] = docs[p.name]
        props[p.name] = entry
        if p.default is p.empty:
            required.append(p.name)
    return Tool(name or fn.__name__, description or f"The function {fn.__name__}.",
                {"type": "object", "properties": props, "required": required}, fn)


# ------------------------------------------------------------------------------------------------ calculator
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
            raise ValueError("exponent or base too large")
        out = _BINARY[type(node.op)](a, b)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        out = _UNARY[type(node.op)](_arith(node.operand))
    else:
        raise ValueError(f"only numbers, + - * / // % ** and parentheses (not {type(node).__name__})")
    if isinstance(out, complex) or abs(out) > MAX_MAGNITUDE:
        raise ValueError("result out of range")
    return out


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "13 * 17 + 2".
    """
    text = str(expression).strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression over {MAX_EXPRESSION_CHARS} characters")
    try:
        with warnings.catch_warnings():  # "1if" and the like: a SyntaxWarning on stderr, then the error below
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text[:40]!r}") from None
    try:
        value = _arith(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result out of range")
        value = int(value) if value.is_integer() else round(value, 6)
    return str(value)


BUILTINS: dict[str, Callable[..., Any]] = {"calculator": calculator}


def load_tools(specs: list[str]) -> list[Tool]:
    """``--tools`` entries: built-in names or ``FILE.py:function`` (``LABEL=...`` names the tool otherwise)."""
    tools: list[Tool] = []
    for spec in specs:
        label, source = split_label(spec)
        if source in BUILTINS:
            tool = tool_from_function(BUILTINS[source], label or source)
        else:
            if ":" not in source:
                raise UserError(f"--tools {spec!r}: not a built-in ({', '.join(BUILTINS)}) nor FILE.py:function")
            fn = load_object(source, f"--tools {spec!r}")
            if not callable(fn):
                raise UserError(f"--tools {spec!r}: {source} is not a function")
            tool = tool_from_function(fn, label or None)
        if any(t.name == tool.name for t in tools):
            raise UserError(f"--tools: two tools named {tool.name!r}; name one with NAME=FILE.py:function")
        tools.append(tool)
    return tools


# ------------------------------------------------------------------------------------------------ running
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "junk")


@dataclass
class ToolResult:
    text: str
    error: str | None = None  # one of ERROR_KINDS, None when the tool answered
    truncated: bool = False
    seconds: float = 0.0


class _Captured(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` while tools run: a tool thread's writes go to its own capped buffer, every
    other thread's to the stream that was there before."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.buffers: dict[int, list[str]] = {}
        self.sizes: dict[int, int] = {}
        self.cap = 0

    def write(self, text: str) -> int:
        key = threading.get_ident()
        if key not in self.buffers:
            return self.inner.write(text)
        room = self.cap + 1 - self.sizes[key]
        if room > 0:
            self.buffers[key].append(text[:room])
            self.sizes[key] += min(len(text), room)
        return len(text)

    def flush(self) -> None:
        if threading.get_ident() not in self.buffers:
            self.inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


_capture_lock = threading.Lock()
_captured: dict[str, _Captured] = {}


def _capture(cap: int) -> _Captured:
    """The process's stdout router, installed once (tools print from their own threads)."""
    with _capture_lock:
        out = _captured.get("stdout")
        if out is None or sys.stdout is not out:
            out = _Captured(sys.stdout)
            sys.stdout = out  # type: ignore[assignment]
            _captured["stdout"] = out
        out.cap = max(out.cap, cap)
        return out


@dataclass
class ToolCall:
    """A call in flight: ``done()`` once its result is in (or its deadline passed)."""

    result: ToolResult | None = None
    deadline: float = 0.0
    _event: threading.Event = field(default_factory=threading.Event)
    _finish: Callable[[], ToolResult] | None = None

    def done(self) -> bool:
        return self.result is not None or self._event.is_set() or time.monotonic() >= self.deadline

    def wait(self) -> ToolResult:
        if self.result is None:
            self._event.wait(max(0.0, self.deadline - time.monotonic()))
            assert self._finish is not None
            self.result = self._finish()
        return self.result


class ToolRunner:
    """Calls tools by name with parsed arguments, each in a daemon thread under ``timeout`` seconds, and counts
    what happened (``counts``: calls and each error kind)."""

    def __init__(self, tools: list[Tool], timeout: float = 10.0, max_output: int = 2000):
        self.tools = {t.name: t for t in tools}
        self.timeout, self.max_output = timeout, max_output
        self.counts: dict[str, int] = {"calls": 0, "truncated": 0, **{k: 0 for k in ERROR_KINDS}}

    def error(self, kind: str, message: str) -> ToolCall:
        """A call that fails before it runs (a malformed call, an unknown tool): its error result, counted."""
        self.counts["calls"] += 1
        self.counts[kind] += 1
        return ToolCall(ToolResult(f"error: {message}", kind))

    def call(self, name: str, arguments: dict[str, Any]) -> ToolCall:
        """Start ``name(**arguments)``; ``ToolCall.wait()`` gives its result."""
        tool = self.tools.get(name)
        if tool is None:
            return self.error("unknown_tool", f"no tool named {name!r} (tools: {', '.join(self.tools) or 'none'})")
        missing = [p for p in tool.required if p not in arguments]
        unknown = [k for k in arguments if k not in tool.parameters.get("properties", {})]
        if missing or unknown:
            what = f"missing {', '.join(missing)}" if missing else f"unknown argument {unknown[0]!r}"
            return self.error("bad_arguments", f"{name}: {what}")
        self.counts["calls"] += 1
        stdout = _capture(self.max_output)
        box: dict[str, Any] = {}
        started = time.monotonic()
        call = ToolCall(deadline=started + self.timeout)

        def run() -> None:
            key = threading.get_ident()
            stdout.buffers[key], stdout.sizes[key] = [], 0
            try:
                box["value"] = tool.fn(**arguments)
            except BaseException as e:  # noqa: BLE001 - the tool's failure is the episode's error message
                box["error"] = e
            finally:
                box["printed"] = "".join(stdout.buffers.pop(key, []))
                stdout.sizes.pop(key, None)
                call._event.set()

        threading.Thread(target=run, name=f"dschat-tool-{name}", daemon=True).start()

        def finish() -> ToolResult:
            seconds = time.monotonic() - started
            if not call._event.is_set():
                self.counts["timeout"] += 1
                return ToolResult(f"error: {name} timed out after {self.timeout:g} s", "timeout", seconds=seconds)
            if "error" in box:
                e = box["error"]
                self.counts["raised"] += 1
                return ToolResult(f"error: {name} raised {type(e).__name__}: {first_line(e, 200)}", "raised",
                                  seconds=seconds)
            value = box.get("value")
            text = box.get("printed", "") if value is None else _as_text(value)
            if text is None:
                self.counts["junk"] += 1
                return ToolResult(f"error: {name} returned a {type(value).__name__}, not text", "junk",
                                  seconds=seconds)
            truncated = len(text) > self.max_output
            if truncated:
                self.counts["truncated"] += 1
                text = text[: self.max_output] + " ...[truncated]"
            return ToolResult(text, None, truncated, seconds)

        call._finish = finish
        return call


def _as_text(value: Any) -> str | None:
    """A tool's return value as text: a string as it is, numbers and JSON data as JSON; None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float) and not (isinstance(value, float) and not math.isfinite(value)):
        return json.dumps(value)
    if isinstance(value, list | dict | tuple):
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            return None
    return None
