"""`pod_env`: a container's environment and `$(NAME)` expansion, as the kubelet makes them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.pod_env import ContainerConfigError, container_argv, container_env, expand

VARIABLES = {"KEY": "sk-1", "EMPTY": "", "PORT": "8000"}


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("$(KEY)", "sk-1"),
        ("--api-key=$(KEY)", "--api-key=sk-1"),
        ("$(PORT)$(PORT)", "80008000"),
        ("$(EMPTY)", ""),
        ("$(MISSING)", "$(MISSING)"),  # undefined: as written
        ("$$(KEY)", "$(KEY)"),  # escaped
        ("$$$(KEY)", "$sk-1"),
        ("$$", "$"),
        ("a$b", "a$b"),
        ("$", "$"),
        ("$(KEY", "$(KEY"),  # unclosed
        ("$((KEY)", "$((KEY)"),  # the name `(KEY` is undefined
        ("$()", "$()"),
        ("no reference", "no reference"),
    ],
)
def test_references_expand_as_kubernetes_expands_them(text: str, expanded: str) -> None:
    assert expand(text, VARIABLES) == expanded


SECRETS = {"chat": {"token": "sk-$(A)"}}


def test_the_env_resolves_in_order_and_takes_secret_values_as_they_are() -> None:
    container: dict[str, Any] = {
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(C)"},  # C comes later: as written
            {"name": "C", "value": "c"},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "chat", "key": "token"}}},
            {"name": "BLANK"},
            {"name": "A", "value": "again"},
            {
                "name": "SKIPPED",
                "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}},
            },
        ],
        "command": ["serve", "--api-key", "$(KEY)", "--tag", "$(A)$(B)"],
        "args": ["$(BLANK)", "$(SKIPPED)"],
    }
    env = container_env(container, SECRETS)
    assert env == {"A": "again", "B": "a-$(C)", "C": "c", "KEY": "sk-$(A)", "BLANK": ""}
    argv = container_argv(container, env)
    assert argv == ["serve", "--api-key", "sk-$(A)", "--tag", "againa-$(C)", "", "$(SKIPPED)"]


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ({"name": "gone", "key": "token"}, 'secret "gone" not found (env KEY)'),
        ({"name": "chat", "key": "api-key"}, "couldn't find key api-key in Secret chat (env KEY)"),
    ],
)
def test_a_missing_secret_or_key_keeps_the_container_from_starting(
    ref: dict[str, str], message: str
) -> None:
    container = {"env": [{"name": "KEY", "valueFrom": {"secretKeyRef": ref}}]}
    with pytest.raises(ContainerConfigError) as caught:
        container_env(container, SECRETS)
    assert str(caught.value) == message
    optional = {"env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {**ref, "optional": True}}}]}
    assert container_env(optional, SECRETS) == {}  # unset, and the container starts


def test_the_downward_api_fills_a_field_reference() -> None:
    field = {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    container = {
        "env": [{"name": "POD_IP", "valueFrom": field}],
        "command": ["serve", '{"topic":"kv@$(POD_IP)@m"}'],
    }
    env = container_env(container, {}, {"status.podIP": "10.1.2.3"})
    assert env == {"POD_IP": "10.1.2.3"}
    assert container_argv(container, env) == ["serve", '{"topic":"kv@10.1.2.3@m"}']
