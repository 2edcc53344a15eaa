"""What every config section shares: one error type, strict fields, no bool for a number."""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator


class ConfigError(ValueError):
    """A user-caused configuration problem; the message says what and how to fix it."""


class _Section(BaseModel):
    # inf/nan never make a sensible setting (an lr of inf trains to NaN)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        # pydantic reads `true` as 1 for an int (and `--zero.stage true` as stage 1)
        if isinstance(data, dict):
            for name, value in data.items():
                f = cls.model_fields.get(name)
                if isinstance(value, bool) and f is not None and _numeric(f.annotation):
                    raise ValueError(f"{cls._section_name()}.{name} is a number, got {value!r}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _true_false_or_auto(cls, data: Any) -> Any:
        # every `bool | Literal["auto"]` field: one message for a bad value, not one per
        # member of the union
        if isinstance(data, dict):
            for name, value in list(data.items()):
                f = cls.model_fields.get(name)
                if f is not None and _bool_or_auto_field(f.annotation):
                    data = {**data, name: bool_or_auto(value, f"{cls._section_name()}.{name}")}
        return data

    @classmethod
    def _section_name(cls) -> str:
        return cls.__name__.removesuffix("Config").lower()


def _numeric(annotation: Any) -> bool:
    """Whether a field holds numbers only (int/float, optional, or a Literal of ints)."""
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return all(isinstance(a, int) and not isinstance(a, bool) for a in args)
    if args:
        kinds = [a for a in args if a is not type(None)]
        return bool(kinds) and all(_numeric(a) for a in kinds)
    return annotation in (int, float)


def _bool_or_auto_field(annotation: Any) -> bool:
    return set(get_args(annotation)) == {bool, Literal["auto"]}


def bool_or_auto(v: Any, field: str) -> bool | str:
    """"auto", or anything pydantic reads as a bool (true/1/yes/on ...), with one message
    for a bad value instead of pydantic's one per member of the union."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        return TypeAdapter(bool).validate_python(v)
    except ValidationError:
        raise ValueError(f"{field} must be true, false or auto, got {v!r}") from None
