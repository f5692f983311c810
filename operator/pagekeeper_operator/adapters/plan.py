"""Planning: which rendered objects must be applied, judged as server-side apply would.

An object needs a write when it is missing, when what we render changed since our last apply
(an annotation holds the hash of what we applied, which also catches fields we stopped
setting), or when a field we set was changed by someone else (drift). Fields we do not set --
API-server defaults, fields of other managers -- never cause a write. Objects the spec no
longer wants (a PodDisruptionBudget once the user brings their own) are deleted when we
control them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

from pagekeeper_operator.api.types import quantity_value
from pagekeeper_operator.render.meta import is_controlled_by

APPLIED_HASH_ANNOTATION = "pagekeeper.dev/applied-hash"
# Keys that identify an item of an associative list (the API's merge keys), tried in order.
_MERGE_KEYS = ("uid", "name", "mountPath", "containerPort")
# Values under these keys are quantities, which the API server may rewrite ("1024Mi" -> "1Gi").
_QUANTITY_PARENTS = {"requests", "limits"}
_QUANTITY_KEYS = {"sizeLimit", "averageValue"}
_QUANTITY_CONTEXT = "<quantity>"

ObjectKey = tuple[str, str, str]
"""(apiVersion, kind, name) of a namespaced object of one LLMServer."""
Reason = Literal["missing", "changed", "drifted"]


@dataclass(frozen=True)
class Apply:
    """One server-side apply to issue, and why."""

    manifest: dict[str, Any]
    reason: Reason


def key_of(obj: Mapping[str, Any]) -> ObjectKey:
    return (str(obj["apiVersion"]), str(obj["kind"]), str(obj["metadata"]["name"]))


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    """Hash of a rendered object, ignoring the annotation that stores it."""
    bare = copy.deepcopy(dict(manifest))
    annotations = bare.get("metadata", {}).get("annotations", {})
    annotations.pop(APPLIED_HASH_ANNOTATION, None)
    if not annotations:
        bare.get("metadata", {}).pop("annotations", None)
    text = json.dumps(bare, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamp(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy carrying its own hash, so the next plan knows what we last applied."""
    stamped = copy.deepcopy(dict(manifest))
    annotations = stamped["metadata"].setdefault("annotations", {})
    annotations[APPLIED_HASH_ANNOTATION] = manifest_hash(manifest)
    return stamped


def _quantity(value: str | int) -> Decimal | None:
    try:
        return quantity_value(value)
    except ValueError:
        return None


def _same_scalar(want: Any, have: Any, *, is_quantity: bool) -> bool:
    if want == have and type(want) is type(have):
        return True
    if is_quantity and isinstance(have, str | int) and isinstance(want, str | int):
        wanted, had = _quantity(want), _quantity(have)
        return wanted is not None and wanted == had
    return False


def _merge_key(items: Sequence[Any]) -> str | None:
    if not items or not all(isinstance(item, Mapping) for item in items):
        return None
    return next((k for k in _MERGE_KEYS if all(k in item for item in items)), None)


def _child_context(parent: str, key: str) -> str:
    if parent in _QUANTITY_PARENTS or key in _QUANTITY_KEYS:
        return _QUANTITY_CONTEXT
    return key


def is_subset(want: Any, have: Any, parent: str = "") -> bool:
    """Whether every field of `want` is in `have` with an equal value (the fields we own)."""
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        return all(
            key in have and is_subset(value, have[key], _child_context(parent, key))
            for key, value in want.items()
        )
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        merge_key = _merge_key(want)
        if merge_key is not None:
            # Associative list: other managers may add items, and the server may reorder.
            by_key = {item.get(merge_key): item for item in have if isinstance(item, Mapping)}
            return all(
                item[merge_key] in by_key and is_subset(item, by_key[item[merge_key]], parent)
                for item in want
            )
        return len(want) == len(have) and all(
            is_subset(w, h, parent) for w, h in zip(want, have, strict=True)
        )
    return _same_scalar(want, have, is_quantity=parent == _QUANTITY_CONTEXT)


def judge(desired: Mapping[str, Any], observed: Mapping[str, Any] | None) -> Reason | None:
    """Why `desired` must be applied over `observed`, or None when nothing would change."""
    if observed is None:
        return "missing"
    annotations = observed.get("metadata", {}).get("annotations") or {}
    if annotations.get(APPLIED_HASH_ANNOTATION) != manifest_hash(desired):
        return "changed"
    if not is_subset(desired, observed):
        return "drifted"
    return None


@dataclass(frozen=True)
class Delete:
    """One delete to issue: the object, and its uid as observed (a delete precondition)."""

    key: ObjectKey
    uid: str


def prune(
    unwanted: Sequence[ObjectKey],
    observed: Mapping[ObjectKey, Mapping[str, Any] | None],
    owner_uid: str,
) -> list[Delete]:
    """The unwanted objects to delete: those present and controlled by the owner.

    An object of the same name that someone else made (a user's own PodDisruptionBudget
    named like the server) is never ours to delete.
    """
    return [
        Delete(key=key, uid=str(obj["metadata"].get("uid", "")))
        for key in unwanted
        if (obj := observed.get(key)) is not None and is_controlled_by(obj, uid=owner_uid)
    ]


def plan(
    desired: Sequence[Mapping[str, Any]], observed: Mapping[ObjectKey, Mapping[str, Any] | None]
) -> list[Apply]:
    """The applies that bring `observed` to `desired`; empty when they already agree."""
    actions = []
    for manifest in desired:
        reason = judge(manifest, observed.get(key_of(manifest)))
        if reason is not None:
            actions.append(Apply(manifest=stamp(manifest), reason=reason))
    return actions
