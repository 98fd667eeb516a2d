"""The HTTP front: Kubernetes REST paths, discovery, watch streaming, on a tornado app."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import TYPE_CHECKING, Any

import tornado.web
import yaml
from tornado.iostream import StreamClosedError

from . import errors as E
from . import openapi, protobuf
from . import resources as R
from .errors import ApiError
from .podexec import ExecHandler
from .rbac import ADMIN, request_verb
from .schema import FieldValidation

if TYPE_CHECKING:
    from .emulator import KubeEmulator

VERSION_INFO = {
    "major": "1", "minor": "31", "gitVersion": "v1.31.0-kubeemu", "gitCommit": "kubeemu",
    "gitTreeState": "clean", "buildDate": "2024-08-13T00:00:00Z", "goVersion": "go1.22.5",
    "compiler": "gc", "platform": "linux/amd64",
}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


class BaseHandler(tornado.web.RequestHandler):
    def initialize(self, emu: KubeEmulator) -> None:
        self.emu = emu
        self.store = emu.store

    #: resource paths are authorized per request (ResourceHandler._route); others here
    non_resource = True

    async def prepare(self) -> None:
        self.emu.requests.append((self.request.method, self.request.path,
                                  self.request.query))
        stalled = self.emu.stall_left(self.request.method or "", self.request.path)
        if stalled > 0:
            await asyncio.sleep(stalled)
        if self.non_resource:
            try:
                self.emu.authorizer.check_path(self.request.headers.get("Authorization"),
                                               self.request.path.rstrip("/") or "/")
            except ApiError as e:
                self.write_api_error(e)

    _fields: FieldValidation | None = None

    def field_validation(self) -> FieldValidation:
        """This request's ``fieldValidation`` (its warnings go out as Warning headers)."""
        if self._fields is None:
            self._fields = FieldValidation.parse(self.arg("fieldValidation"))
        return self._fields

    def write_json(self, obj: Any, code: int = 200) -> None:
        self.set_status(code)
        for text in (self._fields.warnings if self._fields is not None else []):
            self.add_header("Warning", "299 - " + json.dumps(text))
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-cache, private")
        self.finish(_dumps(obj))

    def write_api_error(self, err: ApiError) -> None:
        self.write_json(err.status(), err.code)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            self.write_api_error(exc)
            return
        reason = {404: "NotFound", 405: "MethodNotAllowed"}.get(status_code, "InternalError")
        message = str(exc) if exc is not None else self._reason
        self.write_json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                         "status": "Failure", "message": message, "reason": reason,
                         "details": {}, "code": status_code}, status_code)

    def arg(self, name: str) -> str | None:
        value = self.get_query_argument(name, None)
        return value if value not in (None, "") else None

    def flag(self, name: str) -> bool:
        return (self.arg(name) or "").lower() in ("true", "1")

    def int_arg(self, name: str) -> int | None:
        value = self.arg(name)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise E.bad_request(f'{name}: Invalid value: "{value}": must be an integer') from None

    def json_body(self, required: bool = True) -> Any:
        raw = self.request.body
        ctype = (self.request.headers.get("Content-Type") or "").split(";")[0].strip()
        if ctype == protobuf.MEDIA_TYPE:
            return protobuf.decode_body(raw)
        if not raw or not raw.strip():
            if required:
                raise E.bad_request("the body of the request was empty")
            return None
        try:
            return json.loads(raw)
        except ValueError as e:
            raise E.bad_request(f"the body of the request was in an unknown format: {e}") from None


class VersionHandler(BaseHandler):
    def get(self) -> None:
        self.write_json(VERSION_INFO)


class HealthHandler(BaseHandler):
    def get(self, *args: str) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish("ok")


class ApiVersionsHandler(BaseHandler):
    def get(self) -> None:
        self.write_json({"kind": "APIVersions", "versions": ["v1"],
                         "serverAddressByClientCIDRs": [
                             {"clientCIDR": "0.0.0.0/0",
                              "serverAddress": f"127.0.0.1:{self.emu.port}"}]})


class GroupListHandler(BaseHandler):
    def get(self) -> None:
        self.write_json(R.api_group_list())


class GroupHandler(BaseHandler):
    def get(self, group: str) -> None:
        doc = R.api_group(group)
        if doc is None:
            self.write_api_error(E.unknown_route())
        else:
            self.write_json(doc)


class ResourceListHandler(BaseHandler):
    def get(self, group: str = "", version: str = "v1") -> None:
        doc = R.api_resource_list(group, version)
        if doc is None:
            self.write_api_error(E.unknown_route())
        else:
            self.write_json(doc)


class OpenAPIV3Handler(BaseHandler):
    """/openapi/v3 and /openapi/v3/<api/v1 | apis/group/version> (openapi.py)."""

    def get(self, gv: str | None = None) -> None:
        text = openapi.index() if not gv else None
        if gv:
            parts = gv.strip("/").split("/")
            if len(parts) == 2 and parts[0] == "api":
                text = openapi.document("", parts[1])
            elif len(parts) == 3 and parts[0] == "apis":
                text = openapi.document(parts[1], parts[2])
        if text is None:
            self.write_api_error(E.unknown_route())
            return
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-cache, private")
        self.finish(text)


class FallbackHandler(BaseHandler):
    def get(self, *args: str) -> None:
        self.write_api_error(E.unknown_route())

    post = put = patch = delete = get


class ResourceHandler(BaseHandler):
    """Every /api/v1/... and /apis/<group>/<version>/... resource path."""

    non_resource = False
    _watcher = None

    def _route(self, group: str, version: str, rest: str
               ) -> tuple[R.ResourceType, str | None, str | None, str | None, bool]:
        segs = [s for s in rest.split("/") if s]
        legacy_watch = False
        if segs and segs[0] == "watch":
            legacy_watch, segs = True, segs[1:]
        ns = None
        if len(segs) >= 3 and segs[0] == "namespaces":
            inner = R.lookup(group, version, segs[2])
            if inner is not None and inner.namespaced:
                ns, segs = segs[1], segs[2:]
        if not segs or len(segs) > 3:
            raise E.unknown_route()
        rt = R.lookup(group, version, segs[0])
        if rt is None:
            raise E.unknown_route()
        name = segs[1] if len(segs) > 1 else None
        sub = segs[2] if len(segs) > 2 else None
        if sub is not None and sub not in rt.subresources:
            raise E.unknown_route()
        if rt.namespaced and ns is None and name is not None:
            raise E.unknown_route()
        if rt.plural == "namespaces" and name is not None:
            ns = name  # a namespace is authorized in itself, as kube-apiserver does
        verb = request_verb(self.request.method, name is not None, legacy_watch or self.flag("watch"))
        self.emu.authorizer.check(self.request.headers.get("Authorization"), verb, group, rt.plural, sub,
                                  ns, name)
        if rt.plural == "namespaces":
            ns = None
        return rt, ns, name, sub, legacy_watch

    async def get(self, group: str, version: str, rest: str = "") -> None:
        try:
            rt, ns, name, sub, legacy_watch = self._route(group, version, rest)
            if name is None:
                if legacy_watch or self.flag("watch"):
                    await self._watch(rt, ns)
                    return
                self._list(rt, ns)
                return
            if sub == "log":
                await self._pod_log(ns, name)
                return
            self.write_json(self.store.get(rt, ns, name))
        except ApiError as e:
            self.write_api_error(e)

    def _list(self, rt: R.ResourceType, ns: str | None) -> None:
        rv = self.arg("resourceVersion")
        match = self.arg("resourceVersionMatch")
        if match and match not in ("Exact", "NotOlderThan"):
            raise E.bad_request(f'resourceVersionMatch: Unsupported value: "{match}": supported '
                                'values: "Exact", "NotOlderThan"')
        if match and rv is None:
            raise E.bad_request("resourceVersionMatch: Forbidden: resourceVersionMatch is "
                                "forbidden unless resourceVersion is provided")
        if rv not in (None, "0"):
            try:
                wanted = int(rv)
            except ValueError:
                raise E.bad_request(f'resourceVersion: Invalid value: "{rv}": strconv.ParseUint:'
                                    ' parsing: invalid syntax') from None
            if wanted > self.store.rv:
                raise ApiError(504, "Timeout", f"Too large resource version: {wanted}, current: "
                               f"{self.store.rv}", {"causes": [
                                   {"reason": "ResourceVersionTooLarge",
                                    "message": "Too large resource version"}],
                                   "retryAfterSeconds": 1})
            if match == "Exact" and wanted != self.store.rv:
                raise E.gone("The resourceVersion for the provided list is too old.")
        items, list_rv, token, remaining = self.store.list(
            rt, ns, self.arg("labelSelector"), self.arg("fieldSelector"),
            self.int_arg("limit"), self.arg("continue"))
        meta: dict[str, Any] = {"resourceVersion": list_rv}
        if token:
            meta["continue"] = token
            meta["remainingItemCount"] = remaining
        self.write_json({"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta,
                         "items": items})

    def on_connection_close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()

    def _bookmark(self, rt: R.ResourceType, rv: int, annotations: dict | None = None) -> str:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if annotations:
            meta["annotations"] = annotations
        return _dumps({"type": "BOOKMARK", "object": {"kind": rt.kind,
                                                      "apiVersion": rt.api_version,
                                                      "metadata": meta}}) + "\n"

    async def _watch(self, rt: R.ResourceType, ns: str | None) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.int_arg("timeoutSeconds")
        if timeout is None or timeout <= 0:
            timeout = random.uniform(1800, 3600)
        bookmarks = self.flag("allowWatchBookmarks")
        send_initial = self.flag("sendInitialEvents")
        w = self.store.watch(rt, ns, self.arg("labelSelector"), self.arg("fieldSelector"),
                             self.arg("resourceVersion"), loop, send_initial_events=send_initial)
        self.set_status(200)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-cache, private")
        if w.error is not None:
            self.finish(_dumps({"type": "ERROR", "object": w.error.status()}) + "\n")
            return
        self._watcher = w
        self.emu.active_watches += 1
        deadline = loop.time() + timeout
        interval = self.emu.bookmark_interval
        next_bookmark = loop.time() + interval
        try:
            for ev in w.initial:
                out = w.translate(ev)
                if out is not None:
                    self.write(_dumps({"type": out[0], "object": out[1]}) + "\n")
            if send_initial and bookmarks:
                self.write(self._bookmark(rt, w.last_rv, {"k8s.io/initial-events-end": "true"}))
            await self.flush()
            while not w.closed:
                now = loop.time()
                if now >= deadline:
                    if bookmarks:
                        self.write(self._bookmark(rt, w.last_rv))
                    break
                wait = deadline - now
                if bookmarks:
                    wait = min(wait, max(0.0, next_bookmark - now))
                try:
                    ev = await asyncio.wait_for(w.queue.get(), wait)
                except asyncio.TimeoutError:
                    if bookmarks and loop.time() >= next_bookmark - 0.001:
                        self.write(self._bookmark(rt, w.last_rv))
                        await self.flush()
                        next_bookmark = loop.time() + interval
                    continue
                batch = [ev]
                while not w.queue.empty():
                    batch.append(w.queue.get_nowait())
                for item in batch:
                    if item is None:
                        break
                    out = w.translate(item)
                    if out is not None:
                        self.write(_dumps({"type": out[0], "object": out[1]}) + "\n")
                await self.flush()
                if None in batch:
                    break
        except StreamClosedError:
            pass
        finally:
            self.emu.active_watches -= 1
            w.close()
        try:
            self.finish()
        except (StreamClosedError, RuntimeError):
            pass

    async def _pod_log(self, ns: str | None, name: str) -> None:
        pod = self.store.get(R.by_plural("pods"), ns, name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = self.arg("container")
        if container is None:
            if len(containers) > 1:
                raise E.bad_request(f"a container name must be specified for pod {name}, choose "
                                    f"one of: [{' '.join(containers)}]")
            container = containers[0]
        elif container not in containers:
            raise E.bad_request(f"container {container} is not valid for pod {name}")
        previous = self.flag("previous")
        path = self.emu.kubelet.log_path(ns or "", name, container, previous)
        if previous and (path is None or not path.exists()):
            raise E.bad_request(f'previous terminated container "{container}" in pod "{name}" '
                                "not found")
        if path is None or not path.exists():
            raise E.bad_request(f'container "{container}" in pod "{name}" is waiting to start: '
                                "ContainerCreating")
        tail = self.int_arg("tailLines")
        limit = self.int_arg("limitBytes")
        self.set_header("Content-Type", "text/plain")
        data = path.read_bytes()
        if tail is not None:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-tail:]) if tail > 0 else b""
        if limit is not None:
            data = data[:limit]
        self.write(data)
        if self.flag("follow") and not previous:
            offset = path.stat().st_size
            try:
                await self.flush()
                while self.emu.kubelet.is_running(ns or "", name, pod["metadata"]["uid"]):
                    await asyncio.sleep(0.1)
                    size = path.stat().st_size
                    if size > offset:
                        with path.open("rb") as f:
                            f.seek(offset)
                            self.write(f.read(size - offset))
                        offset = size
                        await self.flush()
                with path.open("rb") as f:
                    f.seek(offset)
                    self.write(f.read())
            except (StreamClosedError, FileNotFoundError):
                return
        self.finish()

    async def post(self, group: str, version: str, rest: str = "") -> None:
        try:
            rt, ns, name, sub, _ = self._route(group, version, rest)
            dry = self.arg("dryRun") == "All"
            if name is None and rt.plural.startswith("self"):
                self.write_json(self._review(rt, self.json_body()), 201)
            elif sub == "token":
                self.store.get(rt, ns, name or "")
                self.write_json(self._token_request(ns or "", name or "",
                                                    self.json_body(required=False) or {}), 201)
            elif name is None:
                if rt.namespaced and ns is None:
                    raise E.method_not_allowed()
                obj = self.store.create(rt, ns, self.json_body(), dry_run=dry,
                                        fields=self.field_validation())
                self.write_json(obj, 201)
            elif sub == "binding":
                self.emu.bind_pod(ns or "", name, self.json_body())
                self.write_json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                 "status": "Success", "code": 201}, 201)
            elif sub == "eviction":
                body = self.json_body(required=False) or {}
                opts = body.get("deleteOptions") or {}
                self.store.delete(rt, ns, name, opts.get("gracePeriodSeconds"),
                                  opts.get("propagationPolicy"), opts.get("preconditions"), dry)
                self.write_json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                 "status": "Success", "code": 201}, 201)
            else:
                raise E.method_not_allowed()
        except ApiError as e:
            self.write_api_error(e)

    def _review(self, rt: R.ResourceType, body: dict) -> dict:
        """SelfSubjectAccessReview (may I?) and SelfSubjectReview (who am I?), answered."""
        who = self.emu.authorizer.identify(self.request.headers.get("Authorization"))
        out = {**body, "apiVersion": rt.api_version, "kind": rt.kind,
               "metadata": {"creationTimestamp": None}}
        if rt.kind == "SelfSubjectReview":
            ident = who or ADMIN
            out["status"] = {"userInfo": {"username": ident.user, "groups": list(ident.groups)}}
            return out
        attrs = (body.get("spec") or {}).get("resourceAttributes")
        if attrs is None:
            raise E.invalid_object(rt.kind, rt.group, "", [E.required(
                "spec.resourceAttributes", "exactly one of nonResourceAttributes or "
                "resourceAttributes must be specified")])
        allowed = self.emu.authorizer.allows(
            who, attrs.get("verb") or "", attrs.get("group") or "", attrs.get("resource") or "",
            attrs.get("subresource") or None, attrs.get("namespace") or None,
            attrs.get("name") or None)
        out["status"] = {"allowed": allowed}
        return out

    def _token_request(self, ns: str, name: str, body: dict) -> dict:
        """TokenRequest (serviceaccounts/<name>/token): a token of that service account."""
        spec = body.get("spec") or {}
        seconds = int(spec.get("expirationSeconds") or 3600)
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds))
        return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"name": name, "namespace": ns, "creationTimestamp": None},
                "spec": {"audiences": spec.get("audiences") or ["https://kubernetes.default.svc"],
                         "expirationSeconds": seconds,
                         "boundObjectRef": spec.get("boundObjectRef")},
                "status": {"token": self.emu.authorizer.issue(ns, name),
                           "expirationTimestamp": expires}}

    async def put(self, group: str, version: str, rest: str = "") -> None:
        try:
            rt, ns, name, sub, _ = self._route(group, version, rest)
            if name is None or sub not in (None, "status", "finalize"):
                raise E.method_not_allowed()
            obj = self.store.update(rt, ns, name, self.json_body(),
                                    subresource="status" if sub == "status" else None,
                                    dry_run=self.arg("dryRun") == "All",
                                    fields=self.field_validation())
            self.write_json(obj)
        except ApiError as e:
            self.write_api_error(e)

    async def patch(self, group: str, version: str, rest: str = "") -> None:
        try:
            rt, ns, name, sub, _ = self._route(group, version, rest)
            if name is None or sub not in (None, "status"):
                raise E.method_not_allowed()
            ctype = (self.request.headers.get("Content-Type") or "").split(";")[0].strip()
            kinds = {"application/json-patch+json": "json",
                     "application/merge-patch+json": "merge",
                     "application/strategic-merge-patch+json": "strategic",
                     "application/apply-patch+yaml": "apply"}
            if ctype not in kinds:
                raise E.unsupported_media_type(ctype)
            dry = self.arg("dryRun") == "All"
            if kinds[ctype] == "apply":
                body = self._apply_body()
                try:
                    self.store.get(rt, ns, name)
                except ApiError as e:
                    if e.code != 404:
                        raise
                    body.setdefault("metadata", {})["name"] = name
                    self.write_json(self.store.create(rt, ns, body, dry_run=dry,
                                                      fields=self.field_validation()), 201)
                    return
                obj = self.store.patch(rt, ns, name, "merge", body, sub, dry,
                                       self.field_validation())
            else:
                obj = self.store.patch(rt, ns, name, kinds[ctype], self.json_body(), sub, dry,
                                       self.field_validation())
            self.write_json(obj)
        except ApiError as e:
            self.write_api_error(e)

    def _apply_body(self) -> dict:
        if not self.arg("fieldManager"):
            raise E.bad_request("PATCH: fieldManager is required for apply requests")
        try:
            body = yaml.safe_load(self.request.body or b"{}")
        except yaml.YAMLError as e:
            raise E.bad_request(f"error decoding YAML: {e}") from None
        if not isinstance(body, dict):
            raise E.bad_request("apply patch must be an object")
        return body

    async def delete(self, group: str, version: str, rest: str = "") -> None:
        try:
            rt, ns, name, sub, _ = self._route(group, version, rest)
            if sub is not None:
                raise E.method_not_allowed()
            opts = self.json_body(required=False) or {}
            if not isinstance(opts, dict):
                raise E.bad_request("DeleteOptions must be an object")
            grace = opts.get("gracePeriodSeconds")
            if grace is None:
                grace = self.int_arg("gracePeriodSeconds")
            propagation = opts.get("propagationPolicy") or self.arg("propagationPolicy")
            orphan = opts.get("orphanDependents")
            if orphan is None and self.arg("orphanDependents") is not None:
                orphan = self.flag("orphanDependents")
            if propagation is None and orphan is not None:
                propagation = "Orphan" if orphan else "Background"
            if propagation not in (None, "Orphan", "Background", "Foreground"):
                raise E.bad_request(f'propagationPolicy: Unsupported value: "{propagation}": '
                                    'supported values: "Background", "Foreground", "Orphan"')
            dry = self.arg("dryRun") == "All" or opts.get("dryRun") == ["All"]
            if name is None:
                if rt.kind == "Namespace":
                    raise E.method_not_allowed()
                items = self.store.delete_collection(rt, ns, self.arg("labelSelector"),
                                                     self.arg("fieldSelector"), grace,
                                                     propagation, dry)
                for item in items:
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
                self.write_json({"kind": rt.list_kind, "apiVersion": rt.api_version,
                                 "metadata": {"resourceVersion": str(self.store.rv)},
                                 "items": items})
                return
            obj, removed = self.store.delete(rt, ns, name, grace, propagation,
                                             opts.get("preconditions"), dry)
            if removed and not rt.returns_deleted_object:
                details: dict[str, Any] = {"name": name}
                if rt.group:
                    details["group"] = rt.group
                details["kind"] = rt.plural
                details["uid"] = obj["metadata"].get("uid")
                self.write_json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                                 "status": "Success", "details": details})
            else:
                self.write_json(obj)
        except ApiError as e:
            self.write_api_error(e)


def make_app(emu: KubeEmulator) -> tornado.web.Application:
    a = {"emu": emu}
    return tornado.web.Application([
        (r"/version/?", VersionHandler, a),
        (r"/(healthz|readyz|livez)(/.*)?", HealthHandler, a),
        (r"/api/?", ApiVersionsHandler, a),
        (r"/api/v1/?", ResourceListHandler, a),
        (r"/api/(v1)/namespaces/([^/]+)/pods/([^/]+)/exec/?", ExecHandler, a),
        (r"/api/(v1)/(.+)", _CoreResourceHandler, a),
        (r"/openapi/v3/?", OpenAPIV3Handler, a),
        (r"/openapi/v3/(.+)", OpenAPIV3Handler, a),
        (r"/apis/?", GroupListHandler, a),
        (r"/apis/([^/]+)/?", GroupHandler, a),
        (r"/apis/([^/]+)/([^/]+)/?", ResourceListHandler, a),
        (r"/apis/([^/]+)/([^/]+)/(.+)", ResourceHandler, a),
        (r"/(.*)", FallbackHandler, a),
    ], log_function=lambda handler: None)


class _CoreResourceHandler(ResourceHandler):
    """/api/v1/...: the core group has an empty group name."""

    async def get(self, version: str, rest: str = "") -> None:  # type: ignore[override]
        await super().get("", version, rest)

    async def post(self, version: str, rest: str = "") -> None:  # type: ignore[override]
        await super().post("", version, rest)

    async def put(self, version: str, rest: str = "") -> None:  # type: ignore[override]
        await super().put("", version, rest)

    async def patch(self, version: str, rest: str = "") -> None:  # type: ignore[override]
        await super().patch("", version, rest)

    async def delete(self, version: str, rest: str = "") -> None:  # type: ignore[override]
        await super().delete("", version, rest)
