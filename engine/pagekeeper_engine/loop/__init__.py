"""The engine core's step loop, above the pure core it drives: `engine` (`LLMEngine`: schedule,
run the model through the runner's protocol, apply tokens; synchronous or overlapped),
`request_outputs` (stop checks, finishing requests and their `EngineOutput`s), `oom_recovery`
(out of device memory inside a step: shrink it, preempt, retry), `loop_stats` (the `/metrics`
snapshot and `/admin/defragment`) and `engine_core` (the serving loop: messages
in from the front ends, one step at a time, messages out). Imports no torch; the runner comes
in through `core.protocols`."""
