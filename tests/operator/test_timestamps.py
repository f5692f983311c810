"""The operator's one time-stamp format and parser."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from pagekeeper_operator.api.types import ApiModel, Timestamp
from pagekeeper_operator.failures import is_permanent
from pagekeeper_operator.timestamps import (
    TimestampError,
    format_time,
    parse_or,
    parse_time,
    utc_now,
)

WHEN = datetime(2026, 11, 29, 2, 3, 4, tzinfo=UTC)


def test_a_time_round_trips_in_utc_to_the_second() -> None:
    assert format_time(WHEN) == "2026-11-29T02:03:04Z"
    assert parse_time("2026-11-29T02:03:04Z") == WHEN
    plus_one = datetime(2026, 11, 29, 3, 3, 4, tzinfo=timezone(timedelta(hours=1)))
    assert format_time(plus_one) == "2026-11-29T02:03:04Z"
    assert parse_time("2026-11-29T03:03:04+01:00") == WHEN
    assert parse_time(format_time(utc_now())).tzinfo is UTC


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("yesterday", "unreadable time stamp 'yesterday'"),
        ("2026-11-29T02:03:04", "has no time zone"),
        ("", "unreadable time stamp ''"),
    ],
)
def test_an_unreadable_or_zoneless_stamp_is_a_permanent_error_naming_it(
    text: str, message: str
) -> None:
    with pytest.raises(TimestampError, match=message) as caught:
        parse_time(text)
    assert is_permanent(caught.value)


def test_parse_or_reads_a_missing_or_unreadable_stamp_as_the_default() -> None:
    assert parse_or(None, WHEN) == WHEN
    assert parse_or("not a time", None) is None
    assert parse_or("2026-11-29T02:03:04Z", None) == WHEN


def test_a_naive_datetime_is_never_formatted() -> None:
    with pytest.raises(AssertionError, match="naive datetime"):
        format_time(datetime(2026, 11, 29))


class Stamped(ApiModel):
    at: Timestamp
    maybe: Timestamp | None = None


def test_a_timestamp_field_is_an_aware_datetime_in_code_and_the_one_format_on_the_wire() -> None:
    read = Stamped.model_validate({"at": "2026-11-29T03:03:04.75+01:00"})
    assert read.at == WHEN and read.at.tzinfo is not None  # to the second, in UTC
    assert read.to_api() == {"at": "2026-11-29T02:03:04Z"}
    assert read.model_dump() == {"at": "2026-11-29T02:03:04Z", "maybe": None}
    assert Stamped(at=WHEN + timedelta(microseconds=5)).at == WHEN
    # A copy's update is a field's value like any other: text is read, bad text refused.
    assert read.model_copy(update={"maybe": "2026-11-29T02:03:04Z"}).maybe == WHEN
    for bad in ("yesterday", "2026-11-29T02:03:04", datetime(2026, 11, 29)):
        with pytest.raises(ValidationError):
            Stamped.model_validate({"at": bad})
        with pytest.raises(ValidationError):
            read.model_copy(update={"maybe": bad})
    schema = Stamped.model_json_schema()["properties"]["at"]
    assert (schema["type"], schema["format"]) == ("string", "date-time")
