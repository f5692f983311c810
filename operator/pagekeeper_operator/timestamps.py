"""Time stamps, one way: RFC 3339 in UTC to the second (`2026-11-29T02:03:04Z`) in the API,
timezone-aware `datetime`s in code. The operator's one formatter and one parser.

The API models hold time stamps as `api.types.Timestamp`: an aware `datetime` read through
`parse_time` and written through `format_time`, declared `format: date-time` in the CRD, so the
API server refuses any other text, naming the field. A stamp the parser cannot read (or one
without a zone) raises `TimestampError`, a `failures.UnreadableDataError`: permanent (the webhook
answers 4xx, never a retry loop); a stored object its models refuse is reported in Stalled
(`progress.unreadable_status`). `parse_or` reads the stamps of other objects (a pod's
`finishedAt`, an autoscaler's `lastScaleTime`), where a missing or odd one must not stop a read.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import overload

from pagekeeper_operator.failures import UnreadableDataError

logger = logging.getLogger(__name__)

FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class TimestampError(UnreadableDataError):
    """A time stamp that is not RFC 3339 with a zone."""


def utc_now() -> datetime:
    """Now, in UTC, to the second (what `format_time` keeps)."""
    return datetime.now(UTC).replace(microsecond=0)


def to_second(when: datetime) -> datetime:
    """`when` in UTC to the second: what the API keeps of it, so equal once stored."""
    assert when.tzinfo is not None, f"naive datetime {when!r}: time stamps are timezone-aware"
    return when.astimezone(UTC).replace(microsecond=0)


def format_time(when: datetime) -> str:
    """`when` as the API writes times; a naive `datetime` is a bug, not a UTC time."""
    assert when.tzinfo is not None, f"naive datetime {when!r}: time stamps are timezone-aware"
    return when.astimezone(UTC).strftime(FORMAT)


def parse_time(text: str) -> datetime:
    """An RFC 3339 time stamp, in UTC; TimestampError names the text it cannot read."""
    try:
        when = datetime.fromisoformat(text)
    except (TypeError, ValueError) as exc:
        raise TimestampError(f"unreadable time stamp {text!r} (RFC 3339 expected)") from exc
    if when.tzinfo is None:
        raise TimestampError(f"time stamp {text!r} has no time zone (RFC 3339 expected)")
    return when.astimezone(UTC)


@overload
def parse_or(text: str | None, default: datetime) -> datetime: ...


@overload
def parse_or(text: str | None, default: None) -> datetime | None: ...


def parse_or(text: str | None, default: datetime | None) -> datetime | None:
    """`parse_time(text)`, or `default` where there is none; an unreadable one is logged and
    read as `default` too, for a state machine that must go on (its status says so)."""
    if not text:
        return default
    try:
        return parse_time(text)
    except TimestampError as exc:
        logger.warning("%s; read as %s", exc, default)
        return default
