"""The hub's usage meter: a subscriber of slice events, the activity sampler and the store's owner.

:func:`start_with_hub` (called by ``configure_hub``) waits for the hub, subscribes
:meth:`UsageMeter.on_slice_event` to the allocator's ``slice_events`` (hubext/events.py: grants,
releases with their cause, resumes of swapped-out kernels) and starts the writer
thread and the sampler. Every ``sample_interval_seconds`` the sampler reads the activity of
every held slice and sends the allocator's ledger to the store (``reconcile``): a slice the
store misses (granted while the meter was not yet listening, or a dropped event) is inserted
from its ``created_at``, and an open record whose slice is gone (released while the hub was
down or killed) is closed at the last time it was seen held.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from traitlets import Bool, Dict, Float, Integer, Unicode
from traitlets.config import SingletonConfigurable

from quotas import Allocation, ConfigError

from ..backends import ReleaseCause
from ..events import SliceEvent, SliceEventKind
from ..hubstart import when_hub_is_up
from .activity import ActivityTotals
from .metrics import UsageMetrics
from .prices import PriceTable, load_prices, load_prices_file
from .record import UsageRecord
from .recorder import UsageRecorder
from .store import UsageStore

SPOOL_NAME = "elastic-gpu-usage.spool"
#: seconds after a release during which a slice's burst total that grew is still billed to its
#: record: on Kubernetes the hub hears the release before the pod has finished terminating, and
#: the node agent publishes the pod's last total when it sees the deletion (issue 27)
LATE_BURST_SECONDS = 120.0


class UsageMeter(SingletonConfigurable):
    """Records every GPU slice's life in the hub's database; prices and reports it."""

    enabled = Bool(True, config=True, help="Record GPU usage (configure_hub starts the meter). Default: True.")
    db_url = Unicode(
        "",
        config=True,
        help="""SQLAlchemy URL of the usage store. Default (empty): the hub's own
        JupyterHub.db_url (sqlite:///jupyterhub.sqlite unless the hub is configured otherwise);
        the store has its own tables and alembic version table there.""",
    )
    spool_file = Unicode(
        "",
        config=True,
        help=f"""File where usage events wait while the database cannot be written (replayed in
        order when it can, and at the next start). Default: {SPOOL_NAME} beside the SQLite
        database, else in the hub's working directory.""",
    )
    queue_size = Integer(10000, config=True, help="Usage events the queue holds before it drops. Default: 10000.")
    batch_size = Integer(500, config=True, help="Most usage events written in one transaction. Default: 500.")
    retry_interval_seconds = Float(
        10.0, config=True, help="Seconds between tries to write the spool while the database is down. Default: 10."
    )
    sample_interval_seconds = Float(
        30.0,
        config=True,
        help="""Seconds between activity samples and reconciliations with the allocator's ledger;
        busy seconds are exact to one interval. Default: 30.""",
    )
    prices = Dict(
        config=True,
        help="""Prices per hour by GPU model ('*' for every other model): a mapping with any of
        gpu_hour (a whole card), memory_gib_hour (a GiB of GPU memory) and compute_hour (100 %
        of a card's compute), e.g. {'H100-80GB': {'gpu_hour': 2.5}}. See docs/metering.md.""",
    )
    currency = Unicode("USD", config=True, help="The currency of `prices`. Default: USD.")
    prices_file = Unicode(
        "",
        config=True,
        help="""JSON file with the currency and the prices ({"currency": "EUR", "prices": {...}},
        `prices`' format): the Helm chart's `metering` values, in its ConfigMap
        (/etc/elastic-gpu/metering.json). When set it replaces `prices` and `currency`.
        Default: empty (use `prices` and `currency`).""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.allocator: Any = None
        self.store: UsageStore | None = None
        self.recorder: UsageRecorder | None = None
        self.totals: dict[str, ActivityTotals] = {}
        #: Prometheus counters; start_with_hub puts them in JupyterHub's registry (/hub/metrics)
        self.metrics: UsageMetrics | None = None
        #: per held allocation: (its record's namespace, workspace, GPU share x count, counted up to)
        self._held: dict[str, list] = {}
        #: per allocation released in the last LATE_BURST_SECONDS: its totals, billed until when
        self._closing: dict[str, tuple[ActivityTotals, float]] = {}
        self._restored = False
        self._task: asyncio.Task | None = None
        #: a user's JupyterHub group names (start_with_hub: from the hub's users); None: not recorded
        self.groups_of: Callable[[str], Iterable[str]] | None = None

    # ---- set-up ---------------------------------------------------------------------------------

    def price_table(self) -> PriceTable:
        """The validated prices (ConfigError naming the bad key otherwise)."""
        if self.prices_file:
            return load_prices_file(self.prices_file)
        return load_prices(self.prices, self.currency)

    def resolve_db_url(self, hub_db_url: str = "") -> str:
        return self.db_url or hub_db_url or "sqlite:///jupyterhub.sqlite"

    def resolve_spool(self, db_url: str) -> Path:
        if self.spool_file:
            return Path(self.spool_file)
        url = make_url(db_url)
        if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
            return Path(url.database).absolute().parent / SPOOL_NAME
        return Path(os.getcwd()) / SPOOL_NAME

    def open(self, hub_db_url: str = "") -> UsageStore:
        """Create the store and start the writer thread (tables are created by the first write)."""
        if self.recorder is None:
            try:
                self.price_table()
            except ConfigError as e:  # say it at start; records are kept, reports refuse with the sentence
                self.log.error("GPU usage prices: %s", e.message)
            db_url = self.resolve_db_url(hub_db_url)
            self.store = UsageStore(db_url)
            self.recorder = UsageRecorder(
                self.store,
                self.resolve_spool(db_url),
                queue_size=self.queue_size,
                batch_size=self.batch_size,
                retry_interval=self.retry_interval_seconds,
                logger=self.log,
            )
            self.recorder.start()
            atexit.register(self._flush_at_exit)
        return self.store

    def _flush_at_exit(self) -> None:
        # the hub is exiting (SIGTERM): write what is queued; a SIGKILL is repaired by reconciliation
        if self.recorder is not None:
            self.recorder.stop(timeout=5)

    def attach(self, allocator: Any) -> None:
        """Hear the slice events of ``allocator`` (a :class:`hubext.allocator.GPUAllocator`); idempotent."""
        self.allocator = allocator
        allocator.slice_events.subscribe(self.on_slice_event)

    def close(self) -> None:
        if self._task:
            self._task.cancel()
            self._task = None
        if self.allocator is not None:
            self.allocator.slice_events.unsubscribe(self.on_slice_event)
        if self.recorder is not None:
            self.recorder.stop()
            self.recorder = None
        if self.store is not None:
            self.store.close()
            self.store = None

    # ---- the subscriber (on the event loop: no I/O) --------------------------------------------

    def record_of(self, allocation: Allocation, at: float) -> UsageRecord:
        model, memory = "", 0
        state = getattr(self.allocator, "state", None)
        if state is not None and allocation.gpu_uuids:
            gpu = state.pool.gpu(allocation.gpu_uuids[0])
            if gpu is not None:
                model, memory = gpu.model, gpu.memory_mib
        groups: Iterable[str] = ()
        if self.groups_of is not None:
            try:
                groups = self.groups_of(allocation.owner.user)
            except Exception as e:  # never lose the record for its groups
                self.log.warning("GPU usage: cannot read the hub groups of %s: %s", allocation.owner.user, e)
        return UsageRecord.from_allocation(allocation, gpu_model=model, gpu_memory_mib=memory, at=at, hub_groups=groups)

    def on_slice_event(self, event: SliceEvent) -> None:
        """Queue what happened to a slice for the store (never waits)."""
        if self.recorder is None:
            return
        if event.kind is SliceEventKind.RESUMED:
            self.resumed(event.allocation_id, event.previous_id)
        elif event.kind is SliceEventKind.SWAP_ENDED:
            self.swap_ended(event.allocation_id, event.why, event.at)
        elif event.allocation is not None:
            self._granted_or_released(event.kind, event.allocation, event.why, event.cause)

    def _granted_or_released(
        self, kind: SliceEventKind, allocation: Allocation, why: str, cause: ReleaseCause | None
    ) -> None:
        now = time.time()
        if kind is SliceEventKind.GRANTED:
            record = self.record_of(allocation, now)
            self.totals[allocation.id] = ActivityTotals.at(allocation.created_at or now)
            self._held[allocation.id] = [record.namespace, record.workspace, record.share * record.count, now]
            self._submit({"event": "granted", "record": record.to_dict()})
        elif kind is SliceEventKind.RELEASED:
            self._count_held(allocation.id, now)
            self._held.pop(allocation.id, None)
            totals = self.totals.pop(allocation.id, None)
            if totals is not None:  # the burst since the last sample, up to the release (the pool's last look)
                totals.add({"burst_gpu_seconds": self._final_burst(allocation.id)}, now)
            if totals is not None and (totals.samples or totals.burst_gpu_seconds):
                self._submit(totals.event(allocation.id))
            if totals is not None:
                self._closing[allocation.id] = (totals, now + LATE_BURST_SECONDS)
            self._submit(
                {
                    "event": "released",
                    "id": allocation.id,
                    "at": now,
                    "cause": (cause or ReleaseCause.STOPPED).value,
                    "why": why,
                }
            )

    def _final_burst(self, allocation_id: str) -> float | None:
        """The pool's burst total of a slice it just released (None: not an elastic slice the pool
        measured, or it cannot say). Read from what the pool holds, no driver call."""
        backend = self.allocator.backend if self.allocator is not None else None
        if backend is None:
            return None
        try:
            return backend.slice_activity([allocation_id]).get(allocation_id, {}).get("burst_gpu_seconds")
        except Exception as e:  # the release is recorded whatever the pool says
            self.log.warning("GPU usage: no final burst of %s (%s)", allocation_id, e)
            return None

    def resumed(self, allocation_id: str, previous_id: str) -> None:
        """Say that ``allocation_id`` resumes a kernel swapped out of ``previous_id`` (released with
        ``ReleaseCause.SWAPPED``): the store links the two records, and the gap between them is the
        swapped period. Heard from the broker's RESUMED event; never waits (docs/metering.md)."""
        if self.recorder is not None:
            self._submit({"event": "resumed", "id": allocation_id, "resumes": previous_id})

    def swap_ended(self, previous_id: str, why: str, at: float | None = None) -> None:
        """Say that the kernel swapped out of ``previous_id`` was stopped before it resumed: its
        swapped period ends now (``at``). Heard from the broker's SWAP_ENDED event; never waits."""
        if self.recorder is not None:
            self._submit(
                {"event": "swap_ended", "id": previous_id, "at": time.time() if at is None else at, "why": why}
            )

    def _submit(self, event: dict[str, Any]) -> None:
        if not self.recorder.submit(event) and self.metrics is not None:
            self.metrics.dropped.inc()

    def _count_held(self, allocation_id: str, now: float, busy_seconds: float = 0.0) -> None:
        held = self._held.get(allocation_id)
        if held is None or self.metrics is None:
            return
        namespace, workspace, gpus, since = held
        if now > since:
            self.metrics.held.labels(namespace, workspace).inc((now - since) * gpus)
            held[3] = now
        if busy_seconds > 0:
            self.metrics.busy.labels(namespace, workspace).inc(busy_seconds * gpus)

    # ---- the sampler ------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Load the activity totals of open records (after a restart); retried by every sample."""
        if self._restored or self.store is None:
            return
        records = await asyncio.to_thread(self.store.open_records)
        for record in records:
            self.totals.setdefault(record.id, ActivityTotals.from_record(record))
        self._restored = True

    async def sample(self, now: float | None = None) -> None:
        """One activity sample of every held slice, then reconcile the store with the ledger."""
        if self.recorder is None or self.allocator is None or self.allocator.state is None:
            return
        try:
            await self.restore()
        except Exception as e:  # the database is down: activity waits, the ledger is still sent
            self.log.warning("GPU usage: cannot read open records yet (%s)", e)
        now = time.time() if now is None else now
        live = dict(self.allocator.state.allocations)
        activity = self.allocator.backend.slice_activity(list(live)) if self._restored else {}
        for allocation_id, allocation in live.items():
            busy = 0.0
            if self._restored:  # activity totals continue those of the record (after a restart)
                totals = self.totals.setdefault(
                    allocation_id,
                    ActivityTotals.at(allocation.created_at or now),
                )
                before = totals.busy_seconds
                if allocation_id in activity:
                    totals.add(activity[allocation_id], now)
                    self._submit(totals.event(allocation_id))
                busy = totals.busy_seconds - before
            if allocation_id not in self._held:  # held since before this process (or missed)
                record = self.record_of(allocation, now)
                self._held[allocation_id] = [record.namespace, record.workspace, record.share * record.count, now]
            self._count_held(allocation_id, now, busy)
        for gone in set(self.totals) - set(live):
            del self.totals[gone]
        for gone in set(self._held) - set(live):
            del self._held[gone]
        self._late_bursts(now, live)
        self._submit(
            {"event": "reconcile", "at": now, "live": [self.record_of(a, now).to_dict() for a in live.values()]}
        )

    def _late_bursts(self, now: float, live: dict[str, Allocation]) -> None:
        """Bill to a record closed in the last LATE_BURST_SECONDS what its slice's burst total grew
        by since (the agent's last annotation of a deleted pod); only ever more, only its own."""
        for allocation_id, (_, until) in list(self._closing.items()):
            if now > until or allocation_id in live:
                del self._closing[allocation_id]
        if not self._closing:
            return
        try:
            activity = self.allocator.backend.slice_activity(list(self._closing))
        except Exception as e:  # retried at the next sample
            self.log.warning("GPU usage: no late burst of released slices (%s)", e)
            return
        for allocation_id, (totals, _) in self._closing.items():
            if totals.add_late_burst(activity.get(allocation_id, {}).get("burst_gpu_seconds")):
                self._submit(totals.event(allocation_id))

    async def run_sampler(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception:
                self.log.exception("GPU usage sampler failed; retrying")
            await asyncio.sleep(self.sample_interval_seconds)

    def start_sampler(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self.run_sampler())


def hub_groups(app: Any) -> Callable[[str], list[str]]:
    """A user's group names from the hub's own users (``app.users``, JupyterHub's in-memory users:
    the user of a slice being granted is there; their groups are the ORM relationship, loaded as
    JupyterHub's own handlers load it). A user the hub has not loaded has no groups recorded."""

    index: dict[str, Any] = {}
    absent: set[str] = set()  # names not in the hub's users at the last rebuild
    built = [-1.0]

    def groups_of(name: str) -> list[str]:
        # JupyterHub's users are keyed by id: an index by name, rebuilt once a second (a sample
        # records every held slice at once) and when a name is new to it
        now = time.monotonic()
        if now - built[0] > 1.0 or (name not in index and name not in absent):
            index.clear()
            absent.clear()
            index.update((u.name, u) for u in list(app.users.values()))
            built[0] = now
        if name not in index:
            absent.add(name)
        user = index.get(name)
        return sorted(g.name for g in user.groups) if user is not None else []

    return groups_of


def start_with_hub(hub_start_timeout: float = 600.0) -> None:
    """Start the meter as soon as the hub is up (called from jupyterhub_config.py by configure_hub)."""

    async def start(app: Any) -> None:
        from ..allocator import GPUAllocator

        meter = UsageMeter.instance(config=app.config, log=app.log)
        if not meter.enabled:
            return
        if meter.metrics is None:
            meter.metrics = UsageMetrics()  # JupyterHub's registry: /hub/metrics
        try:
            meter.open(app.db_url)
        except Exception as e:
            app.log.error("GPU usage meter not started: %s", getattr(e, "message", e))
            return
        meter.groups_of = hub_groups(app)
        meter.attach(GPUAllocator.instance(config=app.config, log=app.log))
        meter.start_sampler()
        app.log.info("GPU usage meter recording to %s", meter.store.engine.url.render_as_string(hide_password=True))

    when_hub_is_up(start, hub_start_timeout)
