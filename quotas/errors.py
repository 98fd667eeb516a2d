"""One exception hierarchy; each error carries a sentence for the user and an HTTP status."""

from __future__ import annotations


class AdmissionError(Exception):
    """A request or configuration the admission core cannot accept.

    ``message`` is a sentence a person can act on; ``status`` is the HTTP status an edge (the
    hub's API handlers, the spawner) renders it with.
    """

    status: int = 400
    #: for a waiting decision: only the requester's own slices stand in the way, so waiting in a
    #: queue cannot help (the hub refuses such a request at once, with this sentence)
    own_only: bool = False

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        return self.message


class InvalidRequest(AdmissionError):
    """The request is malformed or can never be satisfied by this pool (400)."""

    status = 400


class QuotaExceeded(AdmissionError):
    """A quota level (user, namespace or workspace) does not leave room for the request (403).

    ``level`` names the level ("workspace 'vision'"), ``resource`` is ``memory_mib``,
    ``cores_percent`` or ``gpus``; ``used``, ``limit`` and ``asked`` are in that resource's unit.
    """

    status = 403
    #: for a wait: no eviction could give the request this quota and no capacity matters to
    #: it (a slice of a class that does not borrow), so only a change in its quota levels can
    #: end the wait (quotas.incremental decides it again only then)
    quota_bound: bool = False

    def __init__(
        self,
        message: str,
        status: int | None = None,
        *,
        level: str = "",
        resource: str = "",
        used: int = 0,
        limit: int = 0,
        asked: int = 0,
    ) -> None:
        super().__init__(message, status)
        self.level = level
        self.resource = resource
        self.used = used
        self.limit = limit
        self.asked = asked


class PoolFull(AdmissionError):
    """No GPU has room for the request right now; it would fit if others stopped (409)."""

    status = 409


class ConfigError(AdmissionError, ValueError):
    """The admission config or the GPU inventory is invalid; ``path`` names the key (e.g.
    ``workspaces.vision.limits.memory_mib``)."""

    status = 400

    def __init__(self, message: str, path: str = "", status: int | None = None) -> None:
        super().__init__(f"{path}: {message}" if path else message, status)
        self.path = path
