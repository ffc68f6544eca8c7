"""Tools: Python functions the policy calls during an episode (``--tools``), and the runner that calls them.

A tool is a function whose signature and docstring are its schema: transformers' ``get_json_schema`` (what TRL and
chat templates use) where it takes the function, and where it refuses one (a parameter without a description or an
annotation, no docstring) the same per-parameter schemas with what the docstring has. ``--tools calculator`` names a
built-in; ``--tools path/to/file.py:function`` loads a user's function.

``ToolRunner`` runs a user's tool in worker processes of its own (``dschat.agents.worker``: up to four per tool,
each started on first use) under ``--tool-timeout`` and caps what comes back (its return value as text, or what it
printed when it returns None) at ``--tool-max-output`` characters. A tool that raises, hangs, spins, prints, returns
junk or ends its process, and a call that cannot be parsed, become an error message in the episode
(``ToolResult.error`` says which kind), never a crashed run: a call past its deadline kills its worker's process
group and the next call starts a fresh worker. The built-in calculator runs in the run's process: it is bounded
(an expression of at most 200 characters, numbers of at most 10^30). A function given as a Python object (not
through ``--tools``) also runs in the run's process, without a deadline.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import time
import typing
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dschat.agents.worker import Job, ToolPool, call_tool, clean, probe, worker_spec
from dschat.errors import UserError
from dschat.userfiles import load_object, split_label


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of an object
    fn: Callable[..., Any]
    source: tuple[str, str] | None = None  # (file, function) of a user's tool: it runs in worker processes
    extra: dict[str, Any] = field(default_factory=dict)  # the schema's other keys (``return``)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF function schema, what a chat template's ``tools=`` takes."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters, **self.extra}}

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required", []))


_EMPTY = inspect.Parameter.empty


def _hint_schema(hint: Any, description: str | None) -> dict[str, Any] | None:
    """One parameter's schema as ``get_json_schema`` writes it for the annotation ``hint`` and the docstring's
    description (a ``(choices: [...])`` suffix becomes its ``enum``); None for an annotation it cannot convert."""
    from transformers.utils import get_json_schema

    for text in ([description] if description else []) + ["x"]:
        def one(x):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - a stand-in carrying the annotation
            pass

        one.__annotations__ = {"x": hint}
        one.__doc__ = f"One parameter.\n\nArgs:\n    x: {text}\n"
        try:
            out = get_json_schema(one)["function"]["parameters"]["properties"]["x"]
        except Exception:  # noqa: BLE001 - an annotation (or a choices list) it refuses
            continue
        if text == "x":
            out.pop("description", None)
            if description:
                out["description"] = description
        return out
    return None


def _param_schema(hint: Any, description: str | None) -> dict[str, Any]:
    """``_hint_schema``; as ``str`` for no annotation or one that does not convert (a custom class)."""
    out = _hint_schema(hint if hint is not _EMPTY else str, description)
    if out is None:
        out = _hint_schema(str, description)
    return out if out is not None else {"type": "string", **({"description": description} if description else {})}


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s function schema (``name``, ``description``, ``parameters``, and ``return`` where its annotation
    converts): exactly ``get_json_schema(fn)["function"]`` when transformers takes ``fn``; otherwise each
    parameter's schema as ``get_json_schema`` writes it for its annotation (``str`` for none or one it cannot
    convert), its description from the docstring's ``Args:`` where it has one, and the description of the tool
    ``The function NAME.`` when the docstring has none."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    try:
        return dict(get_json_schema(fn)["function"])
    except Exception:  # noqa: BLE001 - refused (a parameter without a description or an annotation): built below
        pass
    name = getattr(fn, "__name__", "tool")
    doc = inspect.getdoc(fn) or ""
    description, args, returns = parse_google_format_docstring(doc.strip()) if doc.strip() else (None, {}, None)
    args = args or {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: the ones that are objects
        hints = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if not isinstance(v, str)}
    props: dict[str, Any] = {}
    required = []
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is _EMPTY:
        params = params[1:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        props[p.name] = _param_schema(hints.get(p.name, _EMPTY), args.get(p.name))
        if p.default is _EMPTY:
            required.append(p.name)
    parameters: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description or f"The function {name}.", "parameters": parameters}
    ret = _hint_schema(hints["return"], None) if "return" in hints else None
    if ret is not None:
        out["return"] = {**ret, **({"description": returns} if returns else {})}
    return out


def tool_from_function(fn: Callable[..., Any], name: str | None = None,
                       source: tuple[str, str] | None = None) -> Tool:
    """The tool of ``fn`` (``function_schema``), named ``name`` when given; ``source`` (file, function) for a
    user's tool, which then runs in worker processes."""
    schema = function_schema(fn)
    extra = {k: v for k, v in schema.items() if k not in ("name", "description", "parameters")}
    return Tool(name or schema["name"], schema.get("description") or f"The function {schema['name']}.",
                schema["parameters"], fn, source, extra)


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
    """``--tools`` entries: built-in names or ``FILE.py:function`` (``LABEL=...`` names the tool otherwise). A
    user's file is imported in a child process first (``worker.probe``), so a file that ends its process at import
    is a one-line error."""
    tools: list[Tool] = []
    for spec in specs:
        label, source = split_label(spec)
        if source in BUILTINS:
            tool = tool_from_function(BUILTINS[source], label or source)
        else:
            if ":" not in source:
                raise UserError(f"--tools {spec!r}: not a built-in ({', '.join(BUILTINS)}) nor FILE.py:function")
            fn = load_object(source, f"--tools {spec!r}", probe=probe)
            if not callable(fn):
                raise UserError(f"--tools {spec!r}: {source} is not a function")
            path, _, attr = source.rpartition(":")
            try:
                tool = tool_from_function(fn, label or None, (path, attr))
            except Exception as e:  # noqa: BLE001 - a signature inspect cannot read
                raise UserError(f"--tools {spec!r}: no schema for {attr}: {type(e).__name__}: {e}") from None
        if any(t.name == tool.name for t in tools):
            raise UserError(f"--tools: two tools named {tool.name!r}; name one with NAME=FILE.py:function")
        tools.append(tool)
    return tools


# ------------------------------------------------------------------------------------------------ running
# what a call can come to besides an answer: refused before it runs (the first three), or failed in its worker
REFUSED_KINDS = ("malformed", "unknown_tool", "bad_arguments")
RUN_KINDS = ("raised", "timeout", "junk", "crashed")
ERROR_KINDS = REFUSED_KINDS + RUN_KINDS


@dataclass
class ToolResult:
    text: str
    error: str | None = None  # one of ERROR_KINDS, None when the tool answered
    truncated: bool = False
    seconds: float = 0.0


class ToolCall:
    """A call in flight: ``done()`` once its result is in; ``wait()`` gives it (at most the deadline away)."""

    def __init__(self, result: ToolResult | None = None, job: Job | None = None,
                 finish: Callable[[dict[str, Any]], ToolResult] | None = None):
        self.result, self._job, self._finish = result, job, finish

    def done(self) -> bool:
        return self.result is not None or (self._job is not None and self._job.done())

    def wait(self) -> ToolResult:
        if self.result is None:
            assert self._job is not None and self._finish is not None
            self.result = self._finish(self._job.wait())
        return self.result


def _close_pools(pools: dict[str, ToolPool]) -> None:
    for pool in pools.values():
        pool.close()
    pools.clear()


class ToolRunner:
    """Calls tools by name with parsed arguments under ``timeout`` seconds; each result says what it came to (its
    ``error`` kind, ``truncated``), which the episodes count. A user's tool runs in worker processes (``ToolPool``),
    started on its first call and killed by ``close()``, when the runner is collected, or at the run's end."""

    def __init__(self, tools: list[Tool], timeout: float = 10.0, max_output: int = 2000):
        self.tools = {t.name: t for t in tools}
        self.timeout, self.max_output = timeout, max_output
        self._pools: dict[str, ToolPool] = {}
        self._closer = weakref.finalize(self, _close_pools, self._pools)

    def close(self) -> None:
        """Kill every tool worker (and what the tools forked); a later call starts fresh ones."""
        _close_pools(self._pools)

    def error(self, kind: str, message: str) -> ToolCall:
        """A call that fails before it runs (a malformed call, an unknown tool): its error result."""
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
        started = time.monotonic()

        def finish(reply: dict[str, Any]) -> ToolResult:
            return self._result(name, reply, time.monotonic() - started)

        if tool.source is None:  # the calculator (bounded), or a function given as an object: in this process,
            # its prints not captured (sys.stdout is the whole process's); its return value is its answer
            return ToolCall(finish(call_tool(tool.fn, arguments, self.max_output)))
        return ToolCall(job=self._pool(name).submit(arguments), finish=finish)

    def _pool(self, name: str) -> ToolPool:
        pool = self._pools.get(name)
        if pool is None:
            source = self.tools[name].source
            assert source is not None
            pool = self._pools[name] = ToolPool(worker_spec(*source, self.max_output), f"tool-{name}", self.timeout)
        return pool

    def warm(self) -> None:
        """Start one worker of each tool from a file now, in the background: a run calls this before its models
        load, so the first call does not wait for a process to start while the other rows sample (a waiting row
        feeds masked columns of its answer's length)."""
        for name, tool in self.tools.items():
            if tool.source is not None:
                self._pool(name).warm()

    def _result(self, name: str, reply: dict[str, Any], seconds: float) -> ToolResult:
        """A worker's reply as the call's result, counted. Only plain text crosses: a reply of another shape is
        the worker's fault (``crashed``)."""
        kind, message = reply.get("error"), reply.get("message")
        message = clean(message)[:300] if isinstance(message, str) else ""
        text = reply.get("text")
        if kind is None and not (isinstance(text, str) and isinstance(reply.get("truncated", False), bool)):
            kind, message = "crashed", "its process sent a reply that is not one"
        if kind is not None:
            kind = kind if kind in RUN_KINDS else "crashed"
            said = {"timeout": f"{name} timed out after {self.timeout:g} s",
                    "raised": f"{name} raised {message}",
                    "junk": f"{name} returned {message}",
                    "crashed": f"{name} failed: {message}"}[kind]
            return ToolResult(f"error: {said}", kind, seconds=seconds)
        text = clean(text)
        truncated = bool(reply.get("truncated")) or len(text) > self.max_output
        if truncated:
            text = text[: self.max_output] + " ...[truncated]"
        return ToolResult(text, None, truncated, seconds)
