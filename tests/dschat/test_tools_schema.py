"""A tool's schema is transformers' ``get_json_schema`` (what TRL and chat templates use): exactly, for a function it
takes, and annotation by annotation for one it refuses (a parameter without a description)."""

from __future__ import annotations

import enum
import textwrap
from typing import Any, Literal, Optional, Union

import pytest
from transformers.utils import get_json_schema

from dschat.agents.tools import load_tools, tool_from_function


class Unit(enum.Enum):
    C = "celsius"
    F = "fahrenheit"


class Custom:
    pass


# each annotation with the schema get_json_schema gives it
ANNOTATIONS: list[tuple[Any, dict[str, Any]]] = [
    (str, {"type": "string"}),
    (int, {"type": "integer"}),
    (float, {"type": "number"}),
    (bool, {"type": "boolean"}),
    (list, {"type": "array"}),
    (dict, {"type": "object"}),
    (list[str], {"type": "array", "items": {"type": "string"}}),
    (list[list[int]], {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}),
    (Optional[int], {"type": "integer", "nullable": True}),  # noqa: UP045 - the spelling under test
    (int | None, {"type": "integer", "nullable": True}),
    (Union[int, str], {"type": ["integer", "string"]}),  # noqa: UP007 - the spelling under test
    (Literal["a", "b"], {"type": "string", "enum": ["a", "b"]}),
    (Literal[1, "x"], {"type": ["integer", "string"], "enum": [1, "x"]}),
    (dict[str, int], {"type": "object", "additionalProperties": {"type": "integer"}}),
    (tuple[int, str], {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}),
    (Unit, {"type": "string", "enum": ["celsius", "fahrenheit"]}),
    (Any, {}),
    (list[str] | None, {"type": "array", "items": {"type": "string"}, "nullable": True}),
]


def _reference(hint: Any) -> dict[str, Any]:
    """What get_json_schema writes for a described parameter annotated ``hint`` (its description dropped)."""
    def f(x):  # noqa: ANN001, ANN202
        pass

    f.__annotations__ = {"x": hint}
    f.__doc__ = "F.\n\nArgs:\n    x: the value\n"
    out = get_json_schema(f)["function"]["parameters"]["properties"]["x"]
    out.pop("description")
    return out


@pytest.mark.parametrize("hint, expected", ANNOTATIONS, ids=[str(h) for h, _ in ANNOTATIONS])
def test_each_annotation_gets_get_json_schema_s_type_with_or_without_a_description(hint, expected):
    assert _reference(hint) == expected  # the table is transformers' own

    def described(x, y: int = 0):  # noqa: ANN001, ANN202
        pass

    described.__annotations__ = {"x": hint, "y": int}
    described.__doc__ = "Do it.\n\nArgs:\n    x: the value\n    y: another\n"
    assert tool_from_function(described).schema() == get_json_schema(described)  # exactly the library's
    assert tool_from_function(described).parameters["properties"]["x"] == {**expected, "description": "the value"}

    def undescribed(x, y: int = 0):  # noqa: ANN001, ANN202 - y has no description: get_json_schema refuses it
        pass

    undescribed.__annotations__ = {"x": hint, "y": int}
    undescribed.__doc__ = "Do it.\n\nArgs:\n    x: the value\n"
    with pytest.raises(Exception):  # noqa: B017, PT011 - transformers' own refusal
        get_json_schema(undescribed)
    props = tool_from_function(undescribed).parameters["properties"]
    assert props == {"x": {**expected, "description": "the value"}, "y": {"type": "integer"}}


def test_a_trl_style_tool_gets_exactly_get_json_schema(tmp_path):
    f = tmp_path / "weather.py"
    f.write_text(textwrap.dedent('''
        from __future__ import annotations

        from typing import Literal


        def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius",
                        days: list[int] | None = None) -> dict[str, float]:
            """Get the weather of a city.

            Args:
                city: The city's name.
                unit: The unit of the temperatures.
                days: Days ahead to include.

            Returns:
                The temperature of each day.
            """
            return {}
        '''), encoding="utf-8")
    tool = load_tools([f"{f}:get_weather"])[0]
    fn = tool.fn
    assert tool.schema() == get_json_schema(fn)
    props = tool.parameters["properties"]
    assert props["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert props["days"] == {"type": "array", "items": {"type": "integer"}, "nullable": True,
                             "description": "Days ahead to include."}
    assert tool.required == ["city"]
    renamed = load_tools([f"weather={f}:get_weather"])[0].schema()["function"]
    assert renamed["name"] == "weather" and renamed["parameters"] == tool.parameters


def test_what_get_json_schema_refuses_falls_back_parameter_by_parameter():
    def lookup(city, when: Custom, count: int = 1, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        """Look something up.

        Args:
            city: the city (choices: ["Paris", "Rome"])
        """

    schema = tool_from_function(lookup).schema()["function"]
    assert schema["description"] == "Look something up."
    assert schema["parameters"] == {"type": "object", "required": ["city", "when"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"], "description": "the city"},  # no annotation: str
        "when": {"type": "string"},  # a class get_json_schema cannot convert: a string
        "count": {"type": "integer"}}}

    def choose(city: str):  # noqa: ANN202
        """Choose.

        Args:
            city: the city (choices: ["Paris", "Rome"])
        """

    assert tool_from_function(choose).parameters["properties"]["city"] == {
        "type": "string", "enum": ["Paris", "Rome"], "description": "the city"}

    def bare(x: int):  # noqa: ANN202
        pass

    assert tool_from_function(bare).schema()["function"] == {
        "name": "bare", "description": "The function bare.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
