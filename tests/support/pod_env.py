"""What the kubelet makes of a container's `env`, `command` and `args` before it starts it
(pure): each variable's value, and the `$(NAME)` references in them expanded.

Kubernetes' rules (the kubelet's `makeEnvironmentVariables` over the `expansion` package):
- the variables are resolved in their order; a literal `value` may refer to the ones before it
  (an undefined or later one stays as written); a value from a Secret's key is taken as it is,
  never expanded; a later variable of the same name replaces an earlier one;
- a Secret or key that does not exist keeps the container from starting
  (`CreateContainerConfigError`), unless the reference is `optional`, which leaves it unset;
- `command` and `args` may refer to any of the container's variables;
- `$(NAME)` becomes NAME's value where NAME is defined and stays as written where not; `$$` is an
  escaped `$` (so `$$(NAME)` is the text `$(NAME)`); any other `$`, an unclosed `$(` among them,
  stays as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A Secret's data by name, decoded: {secret name: {key: value}}.
Secrets = Mapping[str, Mapping[str, str]]


class ContainerConfigError(Exception):
    """The kubelet cannot build the container's environment, so it never starts."""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """`text` with its `$(NAME)` references expanded from `variables`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
            continue
        following = text[i + 1]
        close = text.find(")", i + 2) if following == "(" else -1
        if following == "$":
            out.append("$")
        elif close != -1:
            name = text[i + 2 : close]
            out.append(variables.get(name, f"$({name})"))
            i = close + 1
            continue
        else:  # `$` and the character after it, `$(` unclosed among them
            out.append(text[i : i + 2])
        i += 2
    return "".join(out)


def _secret_value(name: str, ref: Mapping[str, Any], secrets: Secrets) -> str | None:
    secret, key = ref["name"], ref["key"]
    is_optional = bool(ref.get("optional", False))
    if secret not in secrets:
        if is_optional:
            return None
        raise ContainerConfigError(f'secret "{secret}" not found (env {name})')
    if key not in secrets[secret]:
        if is_optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in Secret {secret} (env {name})")
    return secrets[secret][key]


def container_env(
    container: Mapping[str, Any], secrets: Secrets, pod_fields: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The container's environment as the kubelet gives it, from its `env` list; `pod_fields`
    gives the downward API's values by field path (`status.podIP`: the pod's IP)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        name = var["name"]
        if var.get("value"):
            env[name] = expand(var["value"], env)
            continue
        source = var.get("valueFrom")
        if source is None:  # no value: the empty string
            env[name] = ""
            continue
        if set(source) == {"fieldRef"}:
            path = source["fieldRef"]["fieldPath"]
            assert pod_fields is not None and path in pod_fields, f"env {name}: no {path} given"
            env[name] = pod_fields[path]
            continue
        assert set(source) == {"secretKeyRef"}, f"cannot resolve env {name} from {source}"
        value = _secret_value(name, source["secretKeyRef"], secrets)
        if value is not None:
            env[name] = value
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The process's argv: `command` then `args`, each expanded from the environment `env`."""
    return [expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]]
