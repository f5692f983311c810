"""Operator entry point.

    kopf run -m pagekeeper_operator.main --all-namespaces        # kopf's own CLI
    python -m pagekeeper_operator.main                           # settings from PAGEKEEPER_* env

Importing this module registers every handler: the LLMServer reconciliation and, when that
package is present, remediation (the Alertmanager webhook and the adaptive policy).
"""

from __future__ import annotations

import importlib
import logging

import kopf

from pagekeeper_operator.controllers import handlers
from pagekeeper_operator.settings import load_settings

logger = logging.getLogger(__name__)
REMEDIATION_HANDLERS = "pagekeeper_operator.controllers.remediation_handlers"


def _load_optional(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Only the module itself may be missing; a broken import inside it must surface.
        if exc.name is None or not module.startswith(exc.name):
            raise
        return False
    return True


HAS_REMEDIATION = _load_optional(REMEDIATION_HANDLERS)


def run() -> None:
    """Run the operator with settings from the environment (see `settings`)."""
    settings = load_settings()
    kopf.configure(
        debug=settings.log_level == "debug",
        quiet=settings.log_level == "warning",
        log_format=kopf.LogFormat[settings.log_format.upper()],
    )
    logger.info("remediation handlers %s", "loaded" if HAS_REMEDIATION else "not installed")
    kopf.run(
        standalone=settings.is_standalone,
        peering_name=None if settings.is_standalone else settings.peering_name,
        priority=settings.priority,
        clusterwide=settings.is_clusterwide,
        namespaces=settings.namespaces,
    )


__all__ = ["HAS_REMEDIATION", "handlers", "run"]

if __name__ == "__main__":
    run()
