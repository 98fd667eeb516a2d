"""The recorder: usage events through a bounded queue to the store, in batches, in a thread.

Admission never waits for the database. :meth:`UsageRecorder.submit` is called by the
allocator's listener on the event loop and only puts the event on a bounded queue
(``put_nowait``); one writer thread takes batches off the queue and applies each in one
transaction. When the database cannot be written (an outage, a lock held too long), the batch
goes to the *spool*, a JSON-lines file, and so does every later batch until the spool has been
replayed into the database (so events stay in order); the writer retries every
``retry_interval`` seconds and at start. A spool left by a previous run is replayed first.

A full queue (the writer is stuck longer than ``queue_size`` events) refuses the event, counts
it in :attr:`UsageRecorder.dropped` and logs it; the meter's periodic reconciliation with the
allocator's ledger repairs the records such an event would have opened or closed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .store import UsageStore

log = logging.getLogger(__name__)

_STOP = object()


class UsageRecorder:
    """Bounded queue -> batches -> :class:`~.store.UsageStore`, spooling while the store is down."""

    def __init__(
        self,
        store: UsageStore,
        spool_path: str | os.PathLike[str],
        *,
        queue_size: int = 10000,
        batch_size: int = 500,
        retry_interval: float = 10.0,
        logger: logging.Logger | logging.LoggerAdapter | None = None,
    ) -> None:
        if queue_size < 1 or batch_size < 1:
            raise ValueError("queue_size and batch_size must be at least 1")
        self.store = store
        self.spool_path = Path(spool_path)
        self.batch_size = batch_size
        self.retry_interval = retry_interval
        self.log = logger or log
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        #: events refused because the queue was full
        self.dropped = 0
        #: events written to the database, and spooled while it was down
        self.written = 0
        self.spooled = 0
        #: the last database error (None while writes succeed)
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None

    # ---- the caller's side (event loop) -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elastic-gpu-usage-writer", daemon=True)
            self._thread.start()

    def submit(self, event: Mapping[str, Any]) -> bool:
        """Queue one event without waiting; False (and counted in ``dropped``) when the queue is full."""
        try:
            self.queue.put_nowait(dict(event))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                self.log.warning(
                    "GPU usage queue full (%d events): %d usage events dropped so far; "
                    "reconciliation with the ledger will repair the records",
                    self.queue.maxsize,
                    self.dropped,
                )
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every event queued before this call is written or spooled (True) or ``timeout``.

        Not for the admission path: it may wait for room in the queue."""
        done = threading.Event()
        try:
            self.queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Write what is queued, then end the writer thread."""
        if self._thread is None:
            return
        self.flush(timeout)
        try:
            self.queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
        self._thread = None

    @property
    def spool_pending(self) -> bool:
        try:
            return self.spool_path.stat().st_size > 0
        except FileNotFoundError:
            return False

    # ---- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        if self.spool_pending:
            self._replay()
        while True:
            try:
                first = self.queue.get(timeout=self.retry_interval if self.spool_pending else None)
            except queue.Empty:
                self._replay()
                continue
            items = [first]
            while len(items) < self.batch_size:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            events = [i for i in items if isinstance(i, dict)]
            if events:
                self._write(events)
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if any(item is _STOP for item in items):
                return

    def _write(self, events: list[dict[str, Any]]) -> None:
        if self.spool_pending:  # keep the order: after what is spooled
            self._spool(events)
            self._replay()
            return
        try:
            self._apply(events)
        except Exception as e:
            self._down(e)
            self._spool(events)

    def _apply(self, events: list[dict[str, Any]]) -> None:
        self.store.ensure_schema()
        self.store.apply(events)
        self.written += len(events)
        if self.last_error is not None:
            self.log.info("GPU usage store is writable again")
            self.last_error = None

    def _down(self, error: Exception) -> None:
        text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        if self.last_error is None:
            self.log.warning(
                "GPU usage store cannot be written (%s); spooling usage events to %s", text, self.spool_path
            )
        self.last_error = text

    def _spool(self, events: list[dict[str, Any]]) -> None:
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.spool_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.spooled += len(events)

    def _replay(self) -> None:
        """Write the spool into the database in one transaction, then empty it (nothing on failure)."""
        try:
            lines = self.spool_path.read_text().splitlines()
        except FileNotFoundError:
            return
        events = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except ValueError:  # a line cut by a crash mid-write
                self.log.warning("GPU usage spool %s: skipping unreadable line %d", self.spool_path, n)
        try:
            self._apply(events)
        except Exception as e:
            self._down(e)
            return
        os.truncate(self.spool_path, 0)
        self.log.info("GPU usage: replayed %d spooled events into the store", len(events))
