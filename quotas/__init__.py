"""The admission core: pure logic that decides whether a GPU request may run now, where, and who yields.

Plain data in (a request, the pool, the live allocations, the quota tree and the policy), a
:class:`Decision` out: grant, grant after preempting, wait, or reject with a sentence a user can
act on. No I/O, no asyncio, no clocks: the hub's allocator and the simulator drive the same code.
See docs/admission.md.
"""

from .config import load_config, load_gpus, load_limits, load_pool, parse_simulated
from .errors import AdmissionError, ConfigError, InvalidRequest, PoolFull, QuotaExceeded
from .model import GPU, Allocation, Decision, GPURequest, Mode, Node, Owner, Pool
from .policy import AdmissionConfig, Placement, Policy, PriorityClass
from .reserve import SoftReservation
from .state import AdmissionState
from .tree import Level, Limits, NamespaceQuota, QuotaTree, WorkspaceQuota

__all__ = [
    "GPU",
    "AdmissionConfig",
    "AdmissionError",
    "AdmissionState",
    "Allocation",
    "ConfigError",
    "Decision",
    "GPURequest",
    "InvalidRequest",
    "Level",
    "Limits",
    "Mode",
    "NamespaceQuota",
    "Node",
    "Owner",
    "Placement",
    "Policy",
    "Pool",
    "PoolFull",
    "PriorityClass",
    "QuotaExceeded",
    "QuotaTree",
    "SoftReservation",
    "WorkspaceQuota",
    "load_config",
    "load_gpus",
    "load_limits",
    "load_pool",
    "parse_simulated",
]
