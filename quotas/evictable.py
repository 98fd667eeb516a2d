"""What preemption asks of the card index: where a request would fit if the allocations a
priority class may evict were gone, and which single allocations free a card alone."""

from __future__ import annotations

from collections.abc import Iterator


class EvictableIndex:
    """Mixed into :class:`quotas.placement.CardIndex` (it reads the index's per-predicate sums)."""

    # ---- preemption support ---------------------------------------------------------------

    def evictable_nodes(
        self, p: int, m: int, c: int, k: int, whole: bool, group: str
    ) -> Iterator[int]:
        """Nodes where the request would fit if every allocation predicate ``p`` may evict
        were gone, in placement order (``node_rank``). Lazy: the cheap per-node bounds pick the
        nodes that might, sorted; the walk of a node's cards runs only when the caller reaches
        it (preemption weighs a few dozen of thousands)."""
        nalloc, en = self.nalloc, self.en[p]
        if whole:
            pempty = self.pempty[p]
            maybe = [ni for ni in range(len(self.wgpus)) if pempty[ni] >= k]
            maybe.sort(key=lambda ni: self.node_rank(ni, group, True))
            wgpus = self.wgpus
            return (
                ni for ni in maybe
                if sum(1 for gi in wgpus[ni].get(group, ()) if nalloc[gi] == en[gi]) >= k
            )
        pmax_m, pmax_c = self.pmax_m[p], self.pmax_c[p]
        cap_m, cap_c, used_m, used_c = self.cap_m, self.cap_c, self.used_m, self.used_c
        em, ec = self.em[p], self.ec[p]
        pkth = self.pkth[p]
        # only nodes with k cards of the group that could ever hold it
        maybe = []
        for ni in self.capable_nodes(m, c, k, False, group):
            if pmax_m[ni] >= m and pmax_c[ni] >= c:
                if k > 1:
                    most_m, most_c = pkth[ni][0], pkth[ni][1]
                    if len(most_m) < k or most_m[k - 1] < m or most_c[k - 1] < c:
                        continue  # fewer than k cards could be cleared enough
                maybe.append(ni)
        maybe.sort(key=lambda ni: self.node_rank(ni, group, False))
        sgpus = self.sgpus

        def enough(ni: int) -> bool:
            n = 0
            for gi in sgpus[ni].get(group, ()):
                if cap_m[gi] - used_m[gi] + em[gi] >= m and cap_c[gi] - used_c[gi] + ec[gi] >= c:
                    n += 1
            return n >= k

        return filter(enough, maybe)

    def single_victims(
        self, p: int, m: int, c: int, k: int, whole: bool, group: str, enough: bool = False
    ) -> list[str]:
        """Ids of allocations predicate ``p`` may evict whose removal alone makes one of their
        cards usable for the request, on nodes where one victim could be enough. ``enough``:
        only those whose node's cards usable now, plus as many as the allocation holds, reach
        ``k`` (fewer could never be enough: a victim frees at most its own cards)."""
        result = []
        on, nalloc = self.on, self.nalloc
        if whole:
            empty, pempty1, en = self.empty[group], self.pempty1[p], self.en[p]
            for ni, wg in enumerate(self.wgpus):
                ready = empty.get(ni, 0)
                if ready + pempty1[ni] < k or (enough and ready + self.span_max[ni] < k):
                    continue
                for gi in wg.get(group, ()):
                    if nalloc[gi] == 1 and en[gi] == 1:
                        if enough and k > 1:
                            allocs = self.node_allocs[ni]
                            result.extend(aid for aid in on[gi] if ready + len(allocs[aid].gpu_uuids) >= k)
                        else:
                            result.extend(on[gi])
            return result
        one_m, one_c = self.p1max_m[p], self.p1max_c[p]
        em1, ec1, elig = self.em1[p], self.ec1[p], self.elig
        cap_m, cap_c, used_m, used_c = self.cap_m, self.cap_c, self.used_m, self.used_c
        pkth = self.pkth[p]
        span_max, kth_m, kth_c = self.span_max, self.kth_m.get(group, {}), self.kth_c.get(group, {})
        for ni in self.capable_nodes(m, c, k, False, group):  # (a victim frees a card that fits)
            sg = self.sgpus[ni]
            if one_m[ni] < m or one_c[ni] < c:
                continue
            if k > 1:
                most_m, most_c = pkth[ni][2], pkth[ni][3]
                if len(most_m) < k or most_m[k - 1] < m or most_c[k - 1] < c:
                    continue  # fewer than k cards are ready or one victim from it
                need = k - span_max[ni] if enough else 0
                if need > 0:  # cards usable now, at most those with that much memory and compute
                    free_m = kth_m.get(ni)
                    if free_m is None or len(free_m) < need or free_m[need - 1] < m or kth_c[ni][need - 1] < c:
                        continue
            found = []
            ready = fixed = 0
            for gi in sg.get(group, ()):
                fm, fc = cap_m[gi] - used_m[gi], cap_c[gi] - used_c[gi]
                if fm >= m and fc >= c:
                    ready += 1
                    continue
                if fm + em1[gi] < m or fc + ec1[gi] < c:
                    continue
                fixable = False
                for aid, (am, ac) in on[gi].items():
                    if elig[aid][p] and fm + am >= m and fc + ac >= c:
                        found.append(aid)
                        fixable = True
                fixed += fixable
            if found and (k == 1 or ready + fixed >= k):
                if enough and k > 1:
                    allocs = self.node_allocs[ni]
                    found = [aid for aid in found if ready + len(allocs[aid].gpu_uuids) >= k]
                result.extend(found)
        return result
