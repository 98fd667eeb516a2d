"""The usage page /hub/gpu/usage and API: /hub/api/gpu/usage (report), /hub/api/gpu/usage/records,
/hub/api/gpu/capacity.

Access uses JupyterHub's ``read:users`` scope and its user filter: an admin (or a service
given ``read:users``) reads everyone's usage; a user holds ``read:users!user=<self>`` and reads
their own only (asking for another user's is 403). Capacity planning needs ``read:users``
for all users. Query parameters:

``from``, ``to``
    the period, ISO 8601 (UTC unless a zone is given) or unix seconds; default the last 30 days;
``by``
    comma-separated groups (user, namespace, workspace, group, model, kind, node, priority_class, day, month);
``user``
    only this user's records;
``format``
    ``json`` (default), ``csv``, ``xlsx`` or ``svg`` (a stacked GPU-hours chart); records: json or csv;
``slice``, ``model``, ``percentile``, ``max_wait``, ``per_node``, ``replay``
    capacity: slice size (1/4, 0.25, 25%, 20GiB), GPU model, percentile (default 95); the replay
    through admission (``replay=0`` skips it) looks for the smallest pool of ``per_node`` GPUs
    per node (8) whose percentile wait is at most ``max_wait`` seconds (30).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import ChoiceLoader, FileSystemLoader
from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.handlers.base import BaseHandler
from tornado import web

from quotas import ConfigError

from .capacity import parse_slice, plan_capacity
from .meter import UsageMeter
from .plot import capacity_svg, held_busy_svg, usage_svg
from .replay import plan_by_replay
from .report import (
    GROUP_KEYS,
    Report,
    ReportError,
    parse_group,
    parse_time,
    records_csv,
    report_csv,
    report_xlsx,
    usage_report,
)

DEFAULT_DAYS = 30
FORMATS = {
    "json": "application/json",
    "csv": "text/csv; charset=utf-8",
    "svg": "image/svg+xml",
    "html": "text/html; charset=utf-8",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
}


class UsageAccess:
    """Shared by the API and the page: the meter, the period, who may be read, the records."""

    def meter(self) -> UsageMeter:
        meter = UsageMeter.instance(config=self.settings.get("config"), log=self.log)
        if meter.store is None:
            from jupyterhub.app import JupyterHub

            meter.open(JupyterHub.instance().db_url if JupyterHub.initialized() else "")
        return meter

    def period(self) -> tuple[float, float]:
        end = parse_time(self.get_argument("to"), "to") if self.get_argument("to", "") else time.time()
        start = (
            parse_time(self.get_argument("from"), "from")
            if self.get_argument("from", "")
            else end - DEFAULT_DAYS * 86400
        )
        return start, end

    def readable_users(self) -> list[str] | None:
        """None: every user; else the users this request may read (403 for another user)."""
        asked = self.get_argument("user", "")
        if asked:
            if not self.has_scope(f"read:users!user={asked}"):
                raise web.HTTPError(403, f"You may not read the GPU usage of user {asked!r}.")
            return [asked]
        if self.has_scope("read:users"):
            return None
        me = self.current_user
        if me is not None and getattr(me, "name", None) and self.has_scope(f"read:users!user={me.name}"):
            return [me.name]
        raise web.HTTPError(403, "Reading GPU usage needs the read:users scope (your own usage: read:users!user).")

    def output_format(self, allowed: tuple[str, ...], default: str = "json") -> str:
        fmt = self.get_argument("format", default)
        if fmt not in allowed:
            raise web.HTTPError(400, f"format {fmt!r} is not offered here; use one of {', '.join(allowed)}.")
        return fmt

    def send(self, fmt: str, body: str | bytes, name: str) -> None:
        self.set_header("Content-Type", FORMATS[fmt])
        if fmt in ("csv", "xlsx"):
            self.set_header("Content-Disposition", f'attachment; filename="{name}.{fmt}"')
        self.finish(body)

    async def records(self, start: float, end: float, users: list[str] | None) -> list[Any]:
        meter = self.meter()
        try:
            return await asyncio.to_thread(meter.store.records, start, end, users)
        except Exception as e:
            self.log.error("GPU usage store cannot be read: %s", e)
            raise web.HTTPError(503, "The GPU usage store cannot be read now; see the hub log.") from None

    async def respond(self) -> None:
        raise NotImplementedError

    async def get(self) -> None:
        try:
            await self.respond()
        except (ReportError, ConfigError) as e:  # bad parameters or prices: the sentence, not a traceback
            raise web.HTTPError(400, e.message) from None


class UsageAPIHandler(UsageAccess, APIHandler):
    """The JSON/CSV/XLSX/SVG API."""


class UsageReportHandler(UsageAPIHandler):
    """GET /hub/api/gpu/usage: the usage report (json, csv, or an svg chart)."""

    async def respond(self) -> None:
        fmt = self.output_format(("json", "csv", "xlsx", "svg"))
        start, end = self.period()
        by = self.get_argument("by", "user")
        users = self.readable_users()
        meter = self.meter()
        prices = meter.price_table()
        now = time.time()
        records = await self.records(start, end, users)
        if fmt == "svg":
            self.send(fmt, usage_svg(records, start, end, by, now=now), "gpu-usage")
            return
        report = usage_report(records, start, end, by.split(","), prices, now=now)
        if fmt == "csv":
            self.send(fmt, report_csv(report), "gpu-usage")
        elif fmt == "xlsx":
            self.send(fmt, report_xlsx(report), "gpu-usage")
        else:
            self.send(fmt, json.dumps(report.to_dict()), "gpu-usage")


class UsageRecordsHandler(UsageAPIHandler):
    """GET /hub/api/gpu/usage/records: the raw records of the period (json or csv)."""

    async def respond(self) -> None:
        fmt = self.output_format(("json", "csv"))
        start, end = self.period()
        records = await self.records(start, end, self.readable_users())
        if fmt == "csv":
            self.send(fmt, records_csv(records), "gpu-usage-records")
        else:
            self.send(fmt, json.dumps({"records": [r.to_dict() for r in records]}), "gpu-usage-records")


class CapacityHandler(UsageAPIHandler):
    """GET /hub/api/gpu/capacity: GPUs needed for the recorded demand at a slice size (json or svg)."""

    async def respond(self) -> None:
        if not self.has_scope("read:users"):
            raise web.HTTPError(403, "Capacity planning reads everyone's usage: it needs the read:users scope.")
        fmt = self.output_format(("json", "svg"))
        start, end = self.period()
        model = self.get_argument("model", "")
        try:
            percentile = float(self.get_argument("percentile", "95"))
        except ValueError:
            raise ReportError("percentile must be a number in (0, 100], such as 95.") from None
        records = await self.records(start, end, None)
        card = next((r.gpu_memory_mib for r in records if r.gpu_model == model and r.gpu_memory_mib), 0)
        fraction = parse_slice(self.get_argument("slice", "1"), card)
        now = time.time()
        plan = plan_capacity(records, start, end, fraction, now=now, percentile=percentile, model=model)
        if fmt == "svg":
            self.send(fmt, capacity_svg(plan), "gpu-capacity")
            return
        body: dict[str, Any] = {**plan.to_dict(), "answer": plan.sentence()}
        if self.get_argument("replay", "1") != "0":
            try:
                max_wait = float(self.get_argument("max_wait", "30"))
                per_node = int(self.get_argument("per_node", "8"))
            except ValueError:
                raise ReportError("max_wait must be seconds (e.g. 30) and per_node a whole number of GPUs.") from None
            try:
                replayed = await asyncio.to_thread(
                    plan_by_replay,
                    records,
                    start,
                    end,
                    fraction,
                    model=model,
                    max_wait_seconds=max_wait,
                    percentile=percentile,
                    gpus_per_node=per_node,
                    now=now,
                )
                body["admission"] = replayed.to_dict()
            except ReportError as e:  # e.g. several models and none chosen: the bound still answers
                body["admission"] = {"error": e.message}
        self.send(fmt, json.dumps(body), "gpu-capacity")


TEMPLATES = Path(__file__).parent / "templates"
#: the page's "Group by" choices besides each key alone (any other the API takes works as ?by=)
GROUP_CHOICES = ("user,day", "user,month", "user,model", "group,user", "workspace,user", "model,day")


class UsagePageHandler(UsageAccess, BaseHandler):
    """GET /hub/gpu/usage: the usage page (admins: everyone; a user: their own), CSV/XLSX downloads."""

    def _add_template_path(self) -> None:
        env = self.settings["jinja2_env"]
        if not getattr(env, "_elastic_gpu_usage_templates", False):
            env.loader = ChoiceLoader([env.loader, FileSystemLoader(str(TEMPLATES))])
            env._elastic_gpu_usage_templates = True

    @web.authenticated
    async def get(self) -> None:
        try:
            await self.respond()
        except (ReportError, ConfigError) as e:  # the page again, its form filled in, and the sentence
            self.set_status(400)
            await self.render_page(self.form(), None, [], error=e.message)

    def form(self) -> dict[str, str]:
        today = datetime.now(timezone.utc).date()
        return {
            "from": self.get_argument("from", "") or (today - timedelta(days=DEFAULT_DAYS - 1)).isoformat(),
            "to": self.get_argument("to", "") or (today + timedelta(days=1)).isoformat(),
            "by": self.get_argument("by", "user"),
        }

    async def respond(self) -> None:
        fmt = self.output_format(("html", "csv", "xlsx"), default="html")
        form = self.form()
        start, end = parse_time(form["from"], "from"), parse_time(form["to"], "to")
        users = self.readable_users()
        meter = self.meter()
        now = time.time()
        records = await self.records(start, end, users)
        report = usage_report(records, start, end, parse_group(form["by"]), meter.price_table(), now=now)
        if fmt == "csv":
            self.send(fmt, report_csv(report), "gpu-usage")
            return
        if fmt == "xlsx":
            self.send(fmt, report_xlsx(report), "gpu-usage")
            return
        charts = (usage_svg(records, start, end, report.by, now=now), held_busy_svg(report))
        await self.render_page(form, report, users, charts=charts)

    async def render_page(
        self,
        form: dict[str, str],
        report: Report | None,
        users: list[str] | None,
        charts: tuple[str, str] = ("", ""),
        error: str = "",
    ) -> None:
        """The page: ``report`` None (a refused query) shows the form and ``error`` only."""
        self._add_template_path()
        by = [k.strip() for k in form["by"].split(",") if k.strip()]
        choices = [*GROUP_KEYS, *GROUP_CHOICES]
        html = await self.render_template(
            "elastic_gpu_usage.html",
            report=report.to_dict() if report is not None else None,
            form=form,
            by=by,
            query=urlencode(form),
            group_choices=choices + ([form["by"]] if form["by"] not in choices else []),
            everyone=users is None,
            users=users or [],
            usage_chart=charts[0],
            held_chart=charts[1],
            error=error,
        )
        self.finish(html)


USAGE_HANDLERS = [
    (r"/gpu/usage", UsagePageHandler),
    (r"/api/gpu/usage", UsageReportHandler),
    (r"/api/gpu/usage/records", UsageRecordsHandler),
    (r"/api/gpu/capacity", CapacityHandler),
]


def configure(c: Any) -> None:
    """Register the usage API and start the meter with the hub (called by ``configure_hub``)."""
    from .meter import start_with_hub

    c.JupyterHub.extra_handlers = list(c.JupyterHub.get("extra_handlers", [])) + USAGE_HANDLERS
    start_with_hub()
