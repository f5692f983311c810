"""All-reduce time and bandwidth between the GPUs of one host, through torch.distributed and
NCCL, one process per GPU, as the tensor-parallel engine runs it: a bf16 tensor of
(rows x hidden) summed in place. The decode step's all-reduce term of the tensor-parallel floor
is 2 x layers x the time at the batch's rows (`docs/benchmarks.md`).

    PYTHONPATH=engine python benchmarks/allreduce.py --size 2 --hidden 4096 8192
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
from typing import Any

import torch
import torch.distributed as dist

ROWS = (1, 8, 64, 256, 2048)
ITERATIONS = 200


def _rank(rank: int, size: int, port: int, hiddens: list[int], results: Any) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=device)
    found = []
    for hidden in hiddens:
        for rows in ROWS:
            x = torch.ones(rows, hidden, dtype=torch.bfloat16, device=device)
            for _ in range(20):
                dist.all_reduce(x)
            x.fill_(1.0)
            dist.all_reduce(x)
            assert float(x[0, 0]) == size, "the all-reduce summed wrongly"
            graph = torch.cuda.CUDAGraph()  # the engine replays its all-reduces in graphs
            with torch.cuda.graph(graph):
                for _ in range(10):
                    dist.all_reduce(x)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            for _ in range(ITERATIONS // 10):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / ITERATIONS
            num_bytes = x.numel() * x.element_size()
            # NCCL's bus bandwidth of a ring all-reduce: 2 (n - 1) / n of the bytes cross a link
            bus = num_bytes * 2 * (size - 1) / size / seconds
            found.append({"hidden": hidden, "rows": rows, "bytes": num_bytes, "us": seconds * 1e6,
                          "bus_gb_s": bus / 1e9})  # fmt: skip
    if rank == 0:
        results.put(found)
    # no destroy_process_group: with graphs that captured the communicator it can hang; the
    # process's exit releases NCCL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "keep NVLink multicast off"
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = dist.TCPStore("127.0.0.1", 0, args.size, is_master=True, wait_for_workers=False)
    processes = [
        context.Process(target=_rank, args=(r, args.size, store.port, args.hidden, results))
        for r in range(args.size)
    ]
    for process in processes:
        process.start()
    found = results.get(timeout=300)
    for process in processes:
        process.join()
    print(f"# all-reduce over {args.size} GPUs ({torch.cuda.get_device_name()}), bf16, in graphs")
    for row in found:
        print(f"  hidden {row['hidden']:5d} x {row['rows']:5d} rows: {row['us']:8.1f} us, "
              f"bus {row['bus_gb_s']:6.1f} GB/s")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
