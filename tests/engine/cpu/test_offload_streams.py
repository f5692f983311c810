"""The offload's copies and waits in order, on the CPU: CUDA's streams and events replaced by
fakes that log each call, copies running at once (as a finished copy would have), so the test
sees which layer's weights each staging buffer holds when each layer begins."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from pagekeeper_engine.attention.torch_ref import TorchRefBackend
from pagekeeper_engine.distributed.group import TensorParallelGroup
from pagekeeper_engine.model.decoder_layer import DecoderLayer
from pagekeeper_engine.model.layers import RotaryEmbedding
from pagekeeper_engine.model.offload import LayerOffload, projections
from tests.engine.shapes import LLAMA_8B

TINY = dataclasses.replace(
    LLAMA_8B, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=24
)


class FakeStream:
    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(f"{self.name} waits for {event.name}")


class FakeEvent:
    def __init__(self, name: str, fakes: Fakes):
        self.name, self.fakes = name, fakes

    def record(self, stream: FakeStream | None = None) -> None:
        on = stream if stream is not None else self.fakes.current
        self.fakes.log.append(f"{on.name} records {self.name}")


class Fakes:
    """torch.cuda's Stream, Event, current_stream and stream, over one log."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.main = FakeStream("main", self.log)
        self.current = self.main
        self.num_events = 0

    def stream_class(self, device: torch.device) -> FakeStream:
        return FakeStream("side", self.log)

    def event_class(self) -> FakeEvent:
        # LayerOffload makes its copy events first, then its release events.
        self.num_events += 1
        return FakeEvent(f"event{self.num_events}", self)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Fakes:
    found = Fakes()
    monkeypatch.setattr(torch.cuda, "Stream", found.stream_class)
    monkeypatch.setattr(torch.cuda, "Event", found.event_class)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: found.current)
    monkeypatch.setattr(torch.cuda, "stream", found.stream)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # no pinning off CUDA
    return found


def layers(num_layers: int) -> nn.ModuleList:
    """Decoder layers whose projections are filled with their layer's index plus one."""
    rotary = RotaryEmbedding(TINY.head_dim, 16, TINY.rope_theta, None)
    built = nn.ModuleList(
        DecoderLayer(TINY, rotary, TorchRefBackend(), torch.float32, TensorParallelGroup())
        for _ in range(num_layers)
    )
    for i, layer in enumerate(built):
        for linear in projections(layer):
            linear.weight.data.fill_(i + 1)
    return built


def staged_layer(model: nn.ModuleList, layer_id: int) -> float:
    """The layer whose weights `layer_id`'s projections read now (they are filled with it + 1):
    every projection must agree."""
    values = {float(linear.weight.mean()) - 1 for linear in projections(model[layer_id])}
    assert len(values) == 1, values
    return values.pop()


def test_copies_wait_for_their_buffer_and_layers_for_their_copy(fakes: Fakes) -> None:
    model = layers(6)
    offload = LayerOffload(model, [1, 3, 4], torch.device("cpu"))
    # copied[j] = event1..3, released[slot] = event4..5
    assert offload.num_staging == 2
    assert offload.staging_bytes == 2 * sum(
        linear.weight.nbytes for linear in projections(model[0])
    )
    seen = {}
    offload.start()
    for i in range(6):
        offload.begin(i)
        seen[i] = staged_layer(model, i)
        offload.end(i)
    # Resident layers read their own weights; each offloaded layer its staged copy of its own.
    assert seen == {i: float(i) for i in range(6)}
    assert fakes.log == [
        "side waits for main",
        "side records event1",  # layer 1 into buffer 0
        "side records event2",  # layer 3 into buffer 1
        "main waits for event1",  # begin(1)
        "main records event4",  # end(1): buffer 0 free once layer 1 has run
        "side waits for event4",
        "side records event3",  # layer 4 into buffer 0
        "main waits for event2",  # begin(3)
        "main records event5",  # end(3): buffer 1 free; nothing left to copy into it
        "main waits for event3",  # begin(4)
        "main records event4",  # end(4)
    ]


def test_one_offloaded_layer_takes_one_buffer(fakes: Fakes) -> None:
    model = layers(3)
    offload = LayerOffload(model, [2], torch.device("cpu"))
    assert offload.num_staging == 1
    offload.start()
    for i in range(3):
        offload.begin(i)
        assert staged_layer(model, i) == i
        offload.end(i)
    assert fakes.log == [
        "side waits for main",
        "side records event1",
        "main waits for event1",
        "main records event2",
    ]
