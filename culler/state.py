"""The culler's only memory across cycles and restarts: the grace warnings it has sent.

Everything else is re-read every cycle, and every action is idempotent (shutting down a kernel
that is gone, or freeing a slice that is free, is a no-op), so a culler killed mid-cycle and
started again simply does the cycle again. Warnings are persisted (atomically: write a temporary
file, then rename) so that a restart neither warns a kernel twice nor mistakes its own warning
for user activity.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .model import GraceWarning


class WarningStore:
    """Warnings by Jupyter kernel id, optionally saved to a JSON file."""

    VERSION = 1

    def __init__(self, path: str = "", log: logging.Logger | None = None) -> None:
        self.path = Path(path) if path else None
        self.log = log or logging.getLogger("culler")
        self.warnings: dict[str, GraceWarning] = {}
        self._dirty = False
        self._write_failed = False

    def load(self) -> None:
        """Read the file if there is one; a damaged file is logged and ignored (costs a re-warning)."""
        if self.path is None or not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != self.VERSION:
                raise ValueError(f"expected {{'version': {self.VERSION}, 'warnings': {{...}}}}")
            self.warnings = {str(k): GraceWarning.from_json(v) for k, v in (data.get("warnings") or {}).items()}
            self.log.info("Loaded %d grace warning(s) from %s", len(self.warnings), self.path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.log.warning("Ignoring culler state file %s: %s", self.path, e)
            self.warnings = {}

    def get(self, kernel_id: str) -> GraceWarning | None:
        return self.warnings.get(kernel_id)

    def put(self, kernel_id: str, warning: GraceWarning) -> None:
        self.warnings[kernel_id] = warning
        self._dirty = True

    def drop(self, kernel_id: str) -> None:
        if self.warnings.pop(kernel_id, None) is not None:
            self._dirty = True

    def keep_only(self, kernel_ids: Iterable[str]) -> None:
        """Forget warnings of kernels that no longer exist."""
        live = set(kernel_ids)
        for kid in [k for k in self.warnings if k not in live]:
            self.drop(kid)

    def save(self) -> None:
        if not self._dirty or self.path is None:
            self._dirty = False
            return
        data = {"version": self.VERSION, "warnings": {k: w.to_json() for k, w in self.warnings.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".culler-state-", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._dirty = False
            self._write_failed = False
        except OSError as e:
            if not self._write_failed:  # say it once, not every cycle
                self.log.warning(
                    "Cannot write culler state file %s (%s); warnings are kept in memory only", self.path, e
                )
            self._write_failed = True
