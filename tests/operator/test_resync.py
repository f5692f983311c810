"""The resync registry and loop (no kopf timer, so no finalizer on LLMServers)."""

from __future__ import annotations

import asyncio

from pagekeeper_operator.controllers.resync import ServerRegistry, resync_forever


def test_registry_follows_the_event_stream() -> None:
    registry = ServerRegistry()
    registry.observe(None, "b", "two")  # the initial listing has no event type
    registry.observe("ADDED", "a", "one")
    registry.observe("MODIFIED", "a", "one")
    assert registry.snapshot() == [("a", "one"), ("b", "two")]
    registry.observe("DELETED", "a", "one")
    assert registry.snapshot() == [("b", "two")]


def test_one_failing_server_does_not_stop_the_others() -> None:
    registry = ServerRegistry()
    for name in ("bad", "good"):
        registry.observe("ADDED", "ns", name)
    calls: list[str] = []

    async def reconcile_server(namespace: str, name: str) -> None:
        calls.append(name)
        if name == "bad":
            raise RuntimeError("API briefly away")

    async def run_two_rounds() -> None:
        task = asyncio.create_task(resync_forever(registry, reconcile_server, interval=0.01))
        while len(calls) < 4:
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(run_two_rounds())
    assert calls[:4] == ["bad", "good", "bad", "good"]
