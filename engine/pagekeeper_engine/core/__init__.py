"""The pure core: what a step may take and what it holds, as data in and data out. The
scheduler and its preemption rule, the KV-cache manager over the block pool (prefix cache,
block hashes, the host tier's accounting and copy plan, KV events), sequences, sampling
parameters, limits, step outputs and the runner's protocols. Imports no torch, and never the
step loop (`loop/`) that drives it."""
