"""The admission state as plain data for status pages and the CLI (``AdmissionState.usage()``)."""

from __future__ import annotations

from typing import Any

from .model import Mode
from .tree import RESOURCES


class UsageReport:
    """Mixed into :class:`quotas.state.AdmissionState`."""

    # ---- status ---------------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        """Plain data for status pages and the CLI: per GPU and per quota level."""
        ix = self._index
        gpus = []
        for gi, gpu in enumerate(ix.gpus):
            memory = cores = 0
            whole = False
            ids = sorted(ix.on[gi])
            for aid in ids:
                a = self._allocs[aid]
                if a.whole:
                    whole = True
                    memory += gpu.memory_mib
                    cores += 100
                else:
                    memory += a.memory_mib
                    cores += a.cores_percent
            gpus.append(
                {
                    "uuid": gpu.uuid,
                    "model": gpu.model,
                    "node": ix.node_names[ix.node_of_gpu[gi]],
                    "index": gpu.index,
                    "mode": Mode(gpu.mode).value,
                    "memory_used_mib": memory,
                    "memory_total_mib": gpu.memory_mib,
                    "memory_capacity_mib": ix.cap_m[gi],
                    "cores_used_percent": cores,
                    "cores_total_percent": 100,
                    "cores_capacity_percent": ix.cap_c[gi],
                    "whole": whole,
                    "allocations": ids,
                }
            )
        tree = self.config.quotas
        ledger = self._ledger

        def entry(name: str, key: tuple[str, ...]) -> dict[str, Any]:
            u = ledger.usage(key)
            return {
                "name": name,
                "used": {r: u.get(r) for r in RESOURCES},
                "borrowed": {
                    "memory_mib": u.borrowed_memory_mib,
                    "cores_percent": u.borrowed_cores_percent,
                    "gpus": u.borrowed_gpus,
                },
                "allocations": u.allocations,
                "limits": tree.limits_of(key).to_dict(),
            }

        seen: dict[str, dict[str, set[str]]] = {}
        for name, ws in tree.workspaces.items():
            namespaces = seen.setdefault(name, {})
            for ns_name, ns in ws.namespaces.items():
                namespaces.setdefault(ns_name, set()).update(ns.users)
        for key in ledger.keys():
            if len(key) == 3:
                seen.setdefault(key[0], {}).setdefault(key[1], set()).add(key[2])
        workspaces = []
        for ws_name, namespaces in seen.items():
            ws_entry = entry(ws_name, (ws_name,))
            ws_entry["namespaces"] = []
            for ns_name, users in namespaces.items():
                ns_entry = entry(ns_name, (ws_name, ns_name))
                ns_entry["users"] = [entry(u, (ws_name, ns_name, u)) for u in sorted(users)]
                ws_entry["namespaces"].append(ns_entry)
            workspaces.append(ws_entry)
        return {
            "gpus": gpus,
            "workspaces": workspaces,
            "allocations": len(self._allocs),
        }

