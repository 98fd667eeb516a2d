"""The usage store's tables (SQLAlchemy Core), as the newest migration leaves them.

One row per allocation (a slice, or ``count`` slices of one request, from grant to release).
Times are unix seconds (floats): portable across SQLite, PostgreSQL and MySQL, and what the
allocator's ``Allocation.created_at`` already is. The migrations in ``migrations/versions``
create these tables; this module only describes them for queries.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Column, Double, Index, Integer, MetaData, String, Table, Text

#: alembic's version table of the usage store (JupyterHub's own is ``alembic_version``, in the same DB)
VERSION_TABLE = "elastic_gpu_alembic_version"

metadata = MetaData()

usage = Table(
    "elastic_gpu_usage",
    metadata,
    Column("id", String(255), primary_key=True),  # the allocation id
    Column("user", String(255), nullable=False),
    Column("namespace", String(255), nullable=False),
    Column("workspace", String(255), nullable=False),
    Column("kind", String(32), nullable=False),  # notebook | kernel
    Column("priority_class", String(255), nullable=False),
    Column("node", String(255), nullable=False),
    Column("gpu_uuids", Text, nullable=False),  # comma-separated
    Column("gpu_model", String(255), nullable=False),
    Column("gpu_memory_mib", Integer, nullable=False),  # one card's memory (0: unknown)
    Column("count", Integer, nullable=False),
    Column("memory_mib", Integer, nullable=False),  # per GPU
    Column("cores_percent", Integer, nullable=False),  # per GPU
    Column("whole", Boolean, nullable=False),
    Column("borrowed", Boolean, nullable=False),
    Column("granted_at", Double, nullable=False),
    Column("released_at", Double, nullable=True),  # NULL while held
    Column("release_cause", String(32), nullable=True),  # hubext.backends.ReleaseCause value, or 'unrecorded'
    Column("release_why", Text, nullable=True),
    Column("last_seen", Double, nullable=False),  # last time the hub saw it held (closes it after a hub crash)
    # revision 0002: activity from the shim's activity file or the node agent's annotation
    Column("busy_seconds", Double, nullable=True),  # NULL: no activity known
    Column("activity_seconds", Double, nullable=True),  # seconds covered by activity samples
    Column("memory_used_peak_mib", Integer, nullable=True),
    Column("memory_used_mean_mib", Double, nullable=True),
    Column("activity_samples", Integer, nullable=False, server_default="0"),
    # revision 0003: the user's hub groups; when it was busy (for capacity replays with an idle timeout)
    Column("hub_groups", Text, nullable=False, server_default=""),
    Column("busy_periods", Text, nullable=True),  # "0-30,90-150": seconds from the grant; NULL: unknown
    # revision 0004: the record this one continues after its kernel was swapped out
    Column("resumes", String(255), nullable=True),
    # revision 0005: when its swapped period ended (its resume's grant, or the kernel stopped while swapped out)
    Column("swap_ended_at", Double, nullable=True),
    # revision 0006: an elastic slice's limits and its use above its request
    Column("memory_limit_mib", Integer, nullable=False, server_default="0"),  # per GPU; 0: none
    Column("cores_limit_percent", Integer, nullable=False, server_default="0"),  # per GPU; 0: none
    Column("burst_gpu_seconds", Double, nullable=True),  # card-seconds above the request; NULL: unknown
    Index("ix_elastic_gpu_usage_granted_at", "granted_at"),
    Index("ix_elastic_gpu_usage_released_at", "released_at"),
    Index("ix_elastic_gpu_usage_user", "user"),
)
