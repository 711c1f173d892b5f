"""attrs validators whose failures are :class:`~mlxkv.cache.errors.InvalidInput`
naming the field: written once for every configuration class of the project."""

from __future__ import annotations

from typing import Any

import attrs

from mlxkv.cache.errors import InvalidInput

__all__ = ["int_at_least", "is_bool", "is_optional_bool"]


def int_at_least(minimum: int) -> Any:
    """A validator: an int (not a bool, nor a subclass) of at least ``minimum``."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if type(value) is not int or value < minimum:
            raise InvalidInput(attribute.name, value, f"must be an int >= {minimum}")

    return check


def is_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A validator: exactly True or False."""
    if type(value) is not bool:
        raise InvalidInput(attribute.name, value, "must be a bool")


def is_optional_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A validator: True, False or None."""
    if value is not None:
        is_bool(instance, attribute, value)
