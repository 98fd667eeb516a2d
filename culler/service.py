"""The culler's own HTTP endpoint: /health, and /metrics for a hub token allowed to access the service.

A scrape's token is checked by ``jupyterhub.services.auth.HubAuth`` (as JupyterHub's own services
do), with its cache: a Prometheus scraping every 15 s costs the hub one call per
``HubAuth.cache_max_age``, not one per scrape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jupyterhub.services.auth import HubAuth
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from tornado import web

if TYPE_CHECKING:
    from .app import GPUCuller


def make_hub_auth(culler: GPUCuller) -> HubAuth:
    """The culler's HubAuth: its own service token, the hub's API URL, responses cached 300 s."""
    return HubAuth(api_url=culler.api_url, api_token=culler.api_token, cache_max_age=300)


class _Base(web.RequestHandler):
    def initialize(self, culler: GPUCuller, hub_auth: HubAuth | None = None) -> None:
        self.culler = culler
        self.hub_auth = hub_auth


class HealthHandler(_Base):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish({"status": "ok", "dry_run": self.culler.dry_run})


class MetricsHandler(_Base):
    async def get(self) -> None:
        if self.culler.authenticate_metrics and not await self._authorized():
            raise web.HTTPError(403, "a hub token with access to this service is required")
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(self.culler.metrics.registry))

    async def _authorized(self) -> bool:
        """Whether the request's token may access this service (``access:services`` scopes)."""
        if self.hub_auth is None:
            return False
        token = self.hub_auth.get_token(self, in_cookie=False)
        if not token:
            return False
        try:
            model = await self.hub_auth.user_for_token(token, sync=False)
        except web.HTTPError:  # the hub did not answer: no metrics, and no traceback
            return False
        if not model:
            return False
        service = self.culler.service_name
        return bool(self.hub_auth.check_scopes({"access:services", f"access:services!service={service}"}, model))
