"""A function tool as OpenAI's clients send it, shared by the server's tests."""

from __future__ import annotations

#: OpenAI's ``tools`` entry for a weather function of one required string.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}  # fmt: skip
