"""A conformance suite any trainer can run: the adapter protocol, the checks, the shipped adapters (docs/conform.md).

``validation.conform.Adapter`` is the protocol an outside trainer implements;
``conform(adapter, spec)`` runs every check on it; ``conform_record`` makes
the evidence record ``rtv conform`` writes.
"""

from __future__ import annotations

from .adapters import NEGATIVE_CONTROLS, SHIPPED
from .checks import FAILED, NOT_APPLICABLE, PASSED, Verdict
from .protocol import CAPABILITIES, Adapter, AdapterError, ConformSpec
from .record import KIND, conform_record, record_parts
from .suite import CHECKS, REQUIRES, AdapterReport, conform, resolve

__all__ = [
    "Adapter",
    "AdapterError",
    "AdapterReport",
    "CAPABILITIES",
    "CHECKS",
    "ConformSpec",
    "FAILED",
    "KIND",
    "NEGATIVE_CONTROLS",
    "NOT_APPLICABLE",
    "PASSED",
    "REQUIRES",
    "SHIPPED",
    "Verdict",
    "conform",
    "conform_record",
    "record_parts",
    "resolve",
]
