"""A serving process's start-up heap, kept out of the garbage collector's full passes.

CPython's collector finds reference cycles by walking the objects it tracks, and a full pass walks
all of them. After an engine core's start-up that is ~450,000 objects (torch, Triton, the model's
modules, the CUDA graphs' records), and on an H200 host one full pass took 0.20-0.26 s: about once
in 8 s of W-nano the loop stopped that long, the device idled, and every stream's next token waited
(docs/benchmarks-archive.md, "a full pass of the garbage collector"). Those objects live as long as
the process, so each serving process (the engine core, a worker rank, a front end) freezes them once
its start-up is done: `gc.freeze` moves them to a permanent generation that no pass walks again.
Start-up's own garbage is collected first. Objects made later are collected as before, and a frozen
object is still freed when its last reference goes; only a cycle among frozen objects is never
collected, which is what `thaw_heap` is for in a process that drops one engine to build another.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Collect start-up's garbage, then take every object still alive out of the collector's
    passes; how many objects are frozen. `process` names the process in the log line."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d objects of its start-up frozen out of the garbage collector's passes",
        process,
        frozen,
    )
    return frozen


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (before dropping an engine whose objects
    may form cycles, so that the next collection frees them)."""
    gc.unfreeze()
