"""The tensor-parallel worker ranks, owned by rank 0 (the engine core): their processes and step
sockets (`workers`), the watchdog that reports one that dies (`watchdog`), what travels between
rank 0 and them (`protocol`), and a worker process's own life (`worker`)."""
