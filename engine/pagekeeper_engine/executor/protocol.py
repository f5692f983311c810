"""What travels between rank 0 and the worker ranks, and how a worker says why it ends.

A worker starts from a `WorkerSpec` (spawn pickles it into the new process). Each step travels
to every worker as MessagePack over its own ZMQ PUSH socket (IPC, no high-water mark), decoded
into `FollowerStep` (rank 0's packed inputs, `runner/follower_step.py`) and nothing else; `None`
tells a worker to stop. A worker that must exit sends a `RankReport` (MessagePack over a pipe,
never pickle) first, so rank 0 can name the reason, and says with its exit code whether it
refused the same start-up budget as rank 0.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.runner.follower_step import FollowerStep

EXIT_SHARED_REFUSAL = 3  # a worker refused what rank 0 refused too (the combined budget)


@dataclass(frozen=True)
class WorkerSpec:
    """What worker `rank` needs to join: the flags, the rendezvous and its step socket."""

    config: EngineConfig
    rank: int
    store_port: int
    step_address: str


def step_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def step_decoder() -> msgspec.msgpack.Decoder[FollowerStep | None]:
    return msgspec.msgpack.Decoder(FollowerStep | None)


class RankReport(msgspec.Struct, array_like=True):
    """Why a worker ends: sent to rank 0 before it exits non-zero."""

    reason: str
    wrote_termination_message: bool


def send_report(reports: Connection, reason: str, *, wrote_termination_message: bool) -> None:
    """The worker's side: hand rank 0 the reason it is about to exit for."""
    report = RankReport(reason, wrote_termination_message)
    with contextlib.suppress(OSError):  # rank 0 gone: it has nothing left to tell
        reports.send_bytes(msgspec.msgpack.encode(report))


def read_report(reports: Connection) -> RankReport | None:
    """Rank 0's side: the report a worker sent before it exited, if it sent one."""
    with contextlib.suppress(EOFError, OSError, msgspec.DecodeError):
        if reports.poll():
            return msgspec.msgpack.decode(reports.recv_bytes(), type=RankReport)
    return None
