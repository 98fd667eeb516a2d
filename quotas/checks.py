"""The checks that make a request invalid (never fits as asked) rather than waiting: its pins,
its shape against the pool's cards, and what its node must give (CPU, host memory)."""

from __future__ import annotations

from . import messages as msg
from .errors import InvalidRequest
from .model import GPURequest, Owner
from .placement import ANY
from .policy import PriorityClass
from .tree import Level


class RequestChecks:
    """Mixed into :class:`quotas.state.AdmissionState` (it reads the state's card index and policy)."""

    def _check_pins(self, request: GPURequest, group: str) -> None:
        """A pinned request names at least ``count`` distinct cards of one node, of its model and mode
        (more than ``count``: any ``count`` of them)."""
        ix, pins = self._index, request.pinned_uuids
        unknown = [u for u in pins if u not in ix.gi_of]
        if unknown:
            raise InvalidRequest(
                f"The GPU(s) {', '.join(unknown)} this request must run on are not in the pool (any more)."
            )
        cards = [ix.gi_of[u] for u in pins]
        nodes = {ix.node_of_gpu[gi] for gi in cards}
        if len(set(cards)) != len(cards) or len(cards) < request.count or len(nodes) != 1:
            raise InvalidRequest(
                f"A request pinned to GPUs names {request.count} or more different GPU(s) of one node; "
                f"got {', '.join(pins)}."
            )
        ok = ix.whole_ok if request.whole else ix.slice_ok
        if any(not ok[gi] or (group != ANY and ix.group[gi] != group) for gi in cards):
            raise InvalidRequest(
                f"The GPU(s) {', '.join(pins)} this request must run on cannot take it (another model, or not "
                f"given out {'whole' if request.whole else 'in slices'})."
            )

    def _check_shape(self, request: GPURequest) -> tuple[PriorityClass, str, tuple[Level, ...]]:
        owner = request.owner
        if not isinstance(owner, Owner) or not isinstance(owner.user, str) or not owner.user:
            raise InvalidRequest("A GPU request needs an owner with a user name.")
        levels = self.levels(owner)
        count = request.count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InvalidRequest(f"Ask for at least 1 GPU; got {count!r}.")
        for value, what in ((request.cpu_millicores, "CPU (millicores)"),
                            (request.host_memory_mib, "host memory (MiB)")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(
                    f"The {what} a GPU request asks of its node must be a whole number of 0 or "
                    f"more; got {value!r}."
                )
        self._check_limits(request)
        if not request.whole:
            m, c = request.memory_mib, request.cores_percent
            if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
                raise InvalidRequest(
                    f"GPU memory must be a whole number of MiB above 0; got {m!r}."
                )
            if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 100:
                raise InvalidRequest(
                    f"GPU compute must be a whole percentage from 1 to 100 per GPU; got {c!r}."
                )
        pc = self.config.policy.priority_class(request.priority_class)
        ix = self._index
        group = ANY
        if request.model:
            group = request.model.lower()
            if group not in ix.model_names:
                raise InvalidRequest(msg.unknown_model(request.model, list(ix.model_names.values())))
        model = ix.model_names.get(group)
        if not ix.gpus:
            raise InvalidRequest(
                "The GPU pool has no GPUs yet. Ask an admin to check the GPU nodes."
            )
        if request.whole:
            most = ix.max_whole_cards.get(group, 0)
            if most == 0:
                raise InvalidRequest(msg.no_whole_card_at_all(model))
            if count > most:
                raise InvalidRequest(msg.too_many_whole(count, model, most))
            self._check_node(request, group)
            return pc, group, levels
        if not ix.max_slice_cards.get(group):
            raise InvalidRequest(msg.no_shared_slices(model))
        m, c = request.memory_mib, request.cores_percent
        biggest = ix.max_card_m.get(group, 0)
        if request.memory_limit_mib > biggest:
            raise InvalidRequest(msg.limit_larger_than_cards(request.memory_limit_mib, model, biggest))
        if m > ix.max_cap_m[group]:
            raise InvalidRequest(msg.slice_larger_than_cards(request, model, ix.max_cap_m[group]))
        if c > ix.max_cap_c[group]:
            raise InvalidRequest(msg.compute_above_cards(request, model, ix.max_cap_c[group]))
        most = ix.most_slice_cards(group, m, c)
        if count > most:
            raise InvalidRequest(msg.too_many_slices(request, model, most))
        self._check_node(request, group)
        return pc, group, levels

    @staticmethod
    def _check_limits(request: GPURequest) -> None:
        """An elastic slice's limits: whole numbers, at least the request, compute at most 100 %."""
        ml, cl = request.memory_limit_mib, request.cores_limit_percent
        for value in (ml, cl):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequest(f"A GPU limit must be a whole number of 0 or more; got {value!r}.")
        if request.whole and (ml or cl):
            raise InvalidRequest(
                "A whole GPU is all of the card already: it has no memory or compute limit to grow to."
            )
        m, c = request.memory_mib, request.cores_percent
        if ml and isinstance(m, int) and ml < m:
            raise InvalidRequest(
                f"A GPU memory limit ({msg.mib(ml)}) must be at least the memory asked for ({msg.mib(m)}); "
                "leave it out for a slice that does not grow."
            )
        if cl and ((isinstance(c, int) and cl < c) or cl > 100):
            raise InvalidRequest(
                f"A GPU compute limit ({cl}%) must be at least the compute asked for ({c}%) and at most "
                "100%; leave it out for a slice that does not grow."
            )

    def _check_node(self, request: GPURequest, group: str) -> None:
        """Reject a request whose CPU or host memory no node with room for its GPUs has."""
        cpu, hmem = request.cpu_millicores, request.host_memory_mib
        if not cpu and not hmem:
            return
        m = 0 if request.whole else request.memory_mib
        c = 0 if request.whole else request.cores_percent
        ix = self._index
        nodes = ix.capable_nodes(m, c, request.count, request.whole, group)
        if not nodes or any(
            ix.cpu_static[ni] >= cpu and ix.hmem_static[ni] >= hmem for ni in nodes
        ):
            return
        most_cpu = max(ix.cpu_static[ni] for ni in nodes)
        most_hmem = max(ix.hmem_static[ni] for ni in nodes)
        raise InvalidRequest(msg.nodes_too_small(request, most_cpu if cpu else 0, most_hmem if hmem else 0))
