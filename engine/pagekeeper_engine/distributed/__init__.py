"""The collectives of tensor parallelism (`group`); how tensors split is `model/shard.py`, and
the rank processes are `executor/`."""
