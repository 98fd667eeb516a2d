"""The expected mix of requests that fragmentation-aware placement keeps room for.

FGD (Weng et al., USENIX ATC '23) scores a placement by how much it lowers the chance that the
requests to come still fit. Those are estimated here from the recent past: the GPU shapes of
the last ``window`` granted requests, the ``top`` most frequent of them with their shares, each
with the mean CPU and host memory its requests asked for.
"""

from __future__ import annotations

from collections import Counter, deque
from operator import itemgetter

#: (memory MiB per GPU, cores % per GPU, GPUs, whole, CPU millicores, host memory MiB)
Shape = tuple[int, int, int, bool, int, int]


class Mix:
    """A sliding window of request shapes. Pure bookkeeping, fed by ``AdmissionState.add``."""

    def __init__(self, window: int = 256, top: int = 8) -> None:
        self.window = window
        self.top = top
        self._recent: deque[Shape] = deque()
        #: GPU shape (memory, cores, GPUs, whole) -> requests, and their CPU and memory in sum
        self._counts: Counter[tuple[int, int, int, bool]] = Counter()
        self._node: dict[tuple[int, int, int, bool], list[int]] = {}
        self._types: list[tuple[Shape, float]] | None = None

    def add(self, shape: Shape) -> None:
        """Count one granted request."""
        self._recent.append(shape)
        self._count(shape, 1)
        if len(self._recent) > self.window:
            self._count(self._recent.popleft(), -1)
        self._types = None

    def _count(self, shape: Shape, sign: int) -> None:
        gpu = shape[:4]
        self._counts[gpu] += sign
        sums = self._node.setdefault(gpu, [0, 0])
        sums[0] += sign * shape[4]
        sums[1] += sign * shape[5]
        if not self._counts[gpu]:
            del self._counts[gpu]
            del self._node[gpu]

    def types(self) -> list[tuple[Shape, float]]:
        """The most frequent GPU shapes with their mean CPU and host memory, and their shares
        (summing to 1); empty before any grant."""
        if self._types is None:
            # the most frequent, ties to the first counted (Counter.most_common's order, for
            # half its CPU: one sort in C), then a stable order: fgd keeps per-node work per
            # list of shapes
            common = sorted(sorted(self._counts.items(), key=itemgetter(1), reverse=True)[: self.top])
            total = sum(n for _, n in common)
            self._types = [
                ((*gpu, self._node[gpu][0] // n, self._node[gpu][1] // n), n / total)
                for gpu, n in common
            ]
        return self._types

    def snapshot(self) -> tuple:
        """What :meth:`restore` puts back (copies: later adds do not change it)."""
        return deque(self._recent), Counter(self._counts), {k: list(v) for k, v in self._node.items()}, self._types

    def restore(self, snapshot: tuple) -> None:
        """The window as it was at ``snapshot`` (which is not to be restored twice)."""
        self._recent, self._counts, self._node, self._types = snapshot

    def __len__(self) -> int:
        return len(self._recent)
