"""--kv-events-config: vLLM's JSON fields, defaults and meanings; errors name the field."""

from __future__ import annotations

import json

import pytest

from pagekeeper_engine.config import parse_args
from pagekeeper_engine.kv_events_config import KVEventsConfig, parse_kv_events_config


def test_absent_flag_means_no_events() -> None:
    assert parse_args(["/m"]).kv_events_config is None


def test_every_field_parses() -> None:
    text = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
            "buffer_steps": 500,
            "hwm": 1000,
            "max_queue_size": 2000,
            "topic": "kv@pod-0",
        }
    )
    config = parse_args(["/m", "--kv-events-config", text]).kv_events_config
    assert config == KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5558",
        buffer_steps=500,
        hwm=1000,
        max_queue_size=2000,
        topic="kv@pod-0",
    )
    assert config.is_publishing


def test_defaults_are_vllms_and_the_publisher_follows_enable() -> None:
    enabled = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert enabled == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    assert (enabled.endpoint, enabled.replay_endpoint) == ("tcp://*:5557", None)
    assert (enabled.buffer_steps, enabled.hwm, enabled.max_queue_size) == (10_000, 100_000, 100_000)
    assert enabled.topic == ""
    assert parse_kv_events_config("{}") == KVEventsConfig(publisher="null")
    assert not parse_kv_events_config("{}").is_publishing
    null = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.is_publishing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("enable", "not JSON"),
        ("[1]", "expected a JSON object"),
        ('{"enable_kv_events": true}', "unknown field 'enable_kv_events'"),
        (
            '{"enable_kv_cache_events": "yes"}',
            'enable_kv_cache_events: expected true or false, got "yes"',
        ),
        ('{"publisher": "kafka"}', 'publisher: "kafka" is not one of null, zmq'),
        ('{"endpoint": "localhost:5557"}', 'endpoint: "localhost:5557" is not a ZMQ endpoint'),
        ('{"endpoint": "tcp://"}', 'endpoint: "tcp://" is not a ZMQ endpoint'),
        ('{"replay_endpoint": 5558}', "replay_endpoint: 5558 is not a ZMQ endpoint"),
        (
            '{"replay_endpoint": "tcp://router:5558"}',
            "replay_endpoint: 'tcp://router:5558' names a host",
        ),
        ('{"replay_endpoint": "tcp://*:5557"}', "replay_endpoint: the same as endpoint"),
        ('{"buffer_steps": 0}', "buffer_steps: 0 is below 1"),
        ('{"buffer_steps": 1.5}', "buffer_steps: expected an integer, got 1.5"),
        ('{"hwm": true}', "hwm: expected an integer, got true"),
        ('{"hwm": -1}', "hwm: -1 is below 0"),
        ('{"max_queue_size": 0}', "max_queue_size: 0 is below 1"),
        ('{"topic": 7}', "topic: expected a string, got 7"),
    ],
)
def test_bad_input_names_the_field(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError) as info:
        parse_kv_events_config(text)
    assert message in str(info.value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["/m", "--kv-events-config", text])
    assert exit_info.value.code == 2
    assert f"argument --kv-events-config: {message}" in capsys.readouterr().err


def test_events_need_the_prefix_cache(capsys: pytest.CaptureFixture[str]) -> None:
    on = '{"enable_kv_cache_events": true}'
    with pytest.raises(SystemExit):
        parse_args(["/m", "--no-enable-prefix-caching", "--kv-events-config", on])
    assert "enable_kv_cache_events reports the prefix cache's blocks" in capsys.readouterr().err
    off = parse_args(["/m", "--no-enable-prefix-caching", "--kv-events-config", "{}"])
    assert off.kv_events_config == KVEventsConfig()
