"""The development harness: what `make demo`, `benchmarks/` and `tests/` share.

The local control plane with KWOK nodes (`cluster`), host processes and their ports
(`processes`), the engine on the CPU with a tiny checkpoint (`cpu_engine`), the operator as a
subprocess (`operator_process`, and `loop` for the alert -> roll loop with Alertmanager's
webhook, with `prometheus` for its reloadable Prometheus), prometheus-adapter (`adapter`) and the
provisioned tools (`tools`). It imports no test module; `tests/support/` keeps what only the tests
use.
"""
