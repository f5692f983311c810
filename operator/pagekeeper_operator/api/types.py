"""Building blocks shared by the LLMServer spec and status models.

Constraints live in the models so that the generated CRD schema (see `crdgen`) and the
operator's own validation agree; cross-field rules are CEL on the model (`cel(...)`) and are
mirrored by a pydantic validator that raises the same message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from decimal import Decimal
from functools import cache
from typing import Annotated, Any, Self, get_args, get_origin

from kubernetes.utils import parse_quantity
from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    StringConstraints,
    TypeAdapter,
    WithJsonSchema,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from pagekeeper_operator.timestamps import format_time, parse_time, to_second

# A non-negative Kubernetes quantity as the API server accepts it ("4", "500m", "16Gi", "1.5G").
QUANTITY_PATTERN = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE])?$"
MAX_NAME_LENGTH = 253
MAX_TEXT_LENGTH = 4096
MAX_LIST_ITEMS = 64
MAX_MAP_ITEMS = 64
JsonDict = dict[str, Any]
STRING_MAP: JsonDict = {"maxProperties": MAX_MAP_ITEMS}
"""`json_schema_extra` of a string-to-string map (labels, annotations)."""


def _quantity_text(value: object) -> object:
    # YAML turns `cpu: 4` into an int; the API server stores quantities as strings.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    StringConstraints(pattern=QUANTITY_PATTERN),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""A Kubernetes resource quantity; an int in YAML is accepted and kept as its text."""


def _timestamp(value: object) -> object:
    """A time stamp as the API or the code gives it, to the second in UTC (what the API keeps):
    text through the one parser (an unreadable one fails validation, naming the field)."""
    if isinstance(value, str):
        value = parse_time(value)
    if isinstance(value, datetime) and value.tzinfo is not None:
        return to_second(value)
    return value  # a naive datetime: AwareDatetime refuses it


Timestamp = Annotated[
    AwareDatetime,
    BeforeValidator(_timestamp),
    PlainSerializer(format_time, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time", "maxLength": 64}),
]
"""A time stamp: a timezone-aware `datetime` in code, RFC 3339 in UTC to the second on the wire
(`timestamps.format_time`); the CRD's `format: date-time` has the API server refuse any other
text, naming the field."""
_STAMP: TypeAdapter[datetime] = TypeAdapter(Timestamp)


def quantity_value(text: str | int) -> Decimal:
    """The number a Kubernetes quantity stands for (`1Gi` -> 1073741824, `500m` -> 0.5).

    Raises ValueError for text that is not a quantity.
    """
    value = parse_quantity(text)  # type: ignore[no-untyped-call]
    assert isinstance(value, Decimal), f"parse_quantity({text!r}) gave {value!r}"
    return value


FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""A Kubernetes core object passed through to the pod unchanged (affinity, a volume, ...).

The API server validates it where it lands (the Deployment), so the CRD keeps it opaque.
"""


def validations(*rules: Mapping[str, str]) -> JsonDict:
    """`json_schema_extra` carrying CEL rules made by `cel`."""
    entries: list[Any] = []
    for rule in rules:
        entry: JsonDict = {}
        entry.update(rule)
        entries.append(entry)
    return {"x-kubernetes-validations": entries}


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry; `message` must name the field it concerns."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


class AliasedModel(BaseModel):
    """Base of the models whose fields each name their wire alias (`Field(alias=...)`); Python
    may use either name."""

    model_config = ConfigDict(populate_by_name=True)


class ApiModel(BaseModel):
    """Base of every LLMServer model: camelCase on the wire, snake_case in Python."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)

    def to_api(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's copy, with time stamps in `update` validated as the fields' own (pydantic
        sets an update as given): text becomes a `datetime`, unreadable text fails."""
        if update:
            stamps = _timestamp_fields(type(self))
            update = {
                k: _STAMP.validate_python(v) if k in stamps and v is not None else v
                for k, v in update.items()
            }
        return super().model_copy(update=update, deep=deep)


@cache
def _timestamp_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that hold a `Timestamp` (or None)."""

    def is_stamp(metadata: Iterable[object]) -> bool:
        return any(isinstance(m, BeforeValidator) and m.func is _timestamp for m in metadata)

    def holds(info: FieldInfo) -> bool:
        nested = [a for a in get_args(info.annotation) if get_origin(a) is Annotated]
        return is_stamp(info.metadata) or any(is_stamp(get_args(a)[1:]) for a in nested)

    return frozenset(name for name, info in model.model_fields.items() if holds(info))
