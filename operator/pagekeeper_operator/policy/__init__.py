"""The memory policy pods run (pure): its layers composed (`effective`) over the tunable fields
(`fields`), the step-down after an OOM (`adaptive`), the memory plan's gate on the GPU and the
host (`fit`, `host_memory`) and what a vLLM pod honours of it (`vllm_compat`)."""
