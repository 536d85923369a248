"""Superseded by :mod:`edatalog.backend.ops`, the one table of scalar ops and aggregations for
numpy and torch.  These names remain only for ``backend/sim.py`` and ``tests/edatalog/test_cli.py``
(which, with ``edatalog/cli/programs.py``, still import this module); delete it once they import
:mod:`edatalog.backend.ops` instead."""

from __future__ import annotations

from edatalog.backend.ops import apply_op, identity, warm_up

__all__ = ["apply_op", "identity", "warm_up"]
