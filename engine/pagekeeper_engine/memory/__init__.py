"""GPU memory: the start-up budget (pure arithmetic), allocator statistics and OOM reporting."""
