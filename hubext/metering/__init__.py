"""GPU metering: a usage store of every slice's life, prices, reports, capacity planning.

- :mod:`.record`, :mod:`.schema`, :mod:`.store`: the records and their SQL store (alembic
  migrations in ``migrations/``), in the hub's own database;
- :mod:`.recorder`: the bounded queue and writer thread (admission never waits), the spool;
- :mod:`.meter`: the hub side: the allocator's listener, activity sampling, reconciliation;
- :mod:`.prices`, :mod:`.report`, :mod:`.capacity`, :mod:`.plot`: pure functions over records;
- :mod:`.handlers`: /hub/api/gpu/usage, /hub/api/gpu/usage/records, /hub/api/gpu/capacity;
- :mod:`.command`: ``elastic-gpu usage`` (the function the CLI calls).

See docs/metering.md.
"""

from .capacity import CapacityPlan, parse_slice, plan_capacity
from .prices import PriceTable, load_prices
from .record import UNRECORDED, UsageRecord
from .report import GROUP_KEYS, Report, ReportError, parse_time, records_csv, report_csv, usage_report
from .store import UsageStore

__all__ = [
    "GROUP_KEYS",
    "UNRECORDED",
    "CapacityPlan",
    "PriceTable",
    "Report",
    "ReportError",
    "UsageRecord",
    "UsageStore",
    "load_prices",
    "parse_slice",
    "parse_time",
    "plan_capacity",
    "records_csv",
    "report_csv",
    "usage_report",
]
