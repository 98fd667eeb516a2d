"""Authentication by service-account token and RBAC authorization, as the API server does them.

The emulator's own kubeconfig token (``kubeemu-token``) is a cluster admin (``system:masters``).
A bearer token the emulator did not issue, or one of a service account deleted since, is
refused on every path with kube-apiserver's 401 ``Unauthorized`` Status (authentication fails
before any authorization; the request is not downgraded to anonymous). A request with no
token at all is ``system:anonymous`` (group ``system:unauthenticated``), as with
kube-apiserver's default ``--anonymous-auth=true``: no binding names it, so it may only read
the public-info paths (``/version``, ``/healthz``, ``/livez``, ``/readyz``) and gets 403 for
everything else. A token from
:meth:`KubeEmulator.service_account_token` is the service account
``system:serviceaccount:<ns>:<name>`` (groups ``system:serviceaccounts``,
``system:serviceaccounts:<ns>``, ``system:authenticated``), and every request it makes is
authorized like kube-apiserver's RBAC authorizer: allowed when a Role (through a RoleBinding in
the request's namespace) or a ClusterRole (through a ClusterRoleBinding, or a RoleBinding in
that namespace) has a rule matching the API group, the resource (``pods/log`` for a
subresource), the verb and, for a named object, ``resourceNames``. Otherwise the request gets
the API server's 403 Status, e.g. ``pods is forbidden: User "system:serviceaccount:hub:hub"
cannot list resource "pods" in API group "" at the cluster scope``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ApiError

if TYPE_CHECKING:
    from .store import Store

GROUP = "rbac.authorization.k8s.io"


@dataclass(frozen=True)
class Identity:
    user: str
    groups: tuple[str, ...]


def request_verb(method: str, named: bool, watch: bool) -> str:
    """The RBAC verb of an HTTP request on a resource path."""
    if method == "GET":
        return "get" if named else ("watch" if watch else "list")
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def _rule_allows(rule: dict, verb: str, group: str, resource: str, name: str | None) -> bool:
    def has(key: str, value: str) -> bool:
        values = rule.get(key) or []
        return "*" in values or value in values

    if not (has("verbs", verb) and has("apiGroups", group) and has("resources", resource)):
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


def _subject_matches(subject: dict, who: Identity, binding_ns: str | None) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return who.user == f"system:serviceaccount:{ns}:{subject.get('name')}"
    if kind == "User":
        return who.user == subject.get("name")
    if kind == "Group":
        return subject.get("name") in who.groups
    return False


#: what every authenticated user may create (ClusterRole system:basic-user)
SELF_REVIEWS = {("authorization.k8s.io", "selfsubjectaccessreviews"),
                ("authorization.k8s.io", "selfsubjectrulesreviews"),
                ("authentication.k8s.io", "selfsubjectreviews")}
ADMIN = Identity("kubeemu-admin", ("system:masters", "system:authenticated"))
#: the token of the emulator's own kubeconfig (emulator.py writes it)
ADMIN_TOKEN = "kubeemu-token"
ANONYMOUS = Identity("system:anonymous", ("system:unauthenticated",))
#: the non-resource paths system:public-info-viewer opens to everyone, anonymous included
PUBLIC_PATHS = ("/version", "/healthz", "/livez", "/readyz")


class Authorizer:
    """Tokens the emulator issued, and the RBAC check of each request made with one."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: issued token -> (its identity, the service account's namespace and name)
        self.tokens: dict[str, tuple[Identity, str, str]] = {}

    def issue(self, namespace: str, name: str) -> str:
        token = f"kubeemu-sa-{secrets.token_hex(16)}"
        self.tokens[token] = (Identity(
            f"system:serviceaccount:{namespace}:{name}",
            ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
        ), namespace, name)
        return token

    def identify(self, authorization: str | None) -> Identity | None:
        """Who makes a request: None (a cluster admin) for the emulator's own token, an issued
        token's service account while that account exists, ``system:anonymous`` without a
        token; any other token raises the API server's 401."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # the scheme is case-insensitive ("bearer" in-cluster)
            token = ""
        token = token.strip()
        if not token:
            return ANONYMOUS
        if token == ADMIN_TOKEN:
            return None
        issued = self.tokens.get(token)
        if issued is None or self.store.raw_object("serviceaccounts", issued[1], issued[2]) is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return issued[0]

    def check_path(self, authorization: str | None, path: str) -> None:
        """A non-resource request (discovery, health): anonymous callers only reach the public
        paths; authenticated ones every path (system:discovery, system:basic-user)."""
        if self.identify(authorization) is not ANONYMOUS:
            return
        if any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS):
            return
        raise ApiError(403, "Forbidden",
                       f'forbidden: User "system:anonymous" cannot get path "{path}"', {})

    def _rules(self, who: Identity, namespace: str | None) -> list[dict]:
        def objects(plural: str) -> list[dict]:
            return self.store.raw_objects(plural, GROUP)

        cluster_roles = {r["metadata"]["name"]: r for r in objects("clusterroles")}
        roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in objects("roles")}
        rules: list[dict] = []
        for binding in objects("clusterrolebindings"):
            if any(_subject_matches(s, who, None) for s in binding.get("subjects") or []):
                rules += (cluster_roles.get(binding["roleRef"]["name"]) or {}).get("rules") or []
        for binding in objects("rolebindings"):
            ns = binding["metadata"]["namespace"]
            if ns != namespace or not any(_subject_matches(s, who, ns) for s in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            if ref.get("kind") == "ClusterRole":
                role = cluster_roles.get(ref.get("name"))
            else:
                role = roles.get((ns, ref.get("name")))
            rules += (role or {}).get("rules") or []
        return rules

    def allows(self, who: Identity | None, verb: str, group: str, plural: str, sub: str | None,
               namespace: str | None, name: str | None) -> bool:
        """Whether ``who`` (None: a cluster admin) may do ``verb`` on the resource."""
        if who is None:
            return True
        if who is not ANONYMOUS and verb == "create" and (group, plural) in SELF_REVIEWS:
            return True  # system:basic-user, bound to every authenticated user
        resource = f"{plural}/{sub}" if sub else plural
        with self.store.lock:
            return any(_rule_allows(r, verb, group, resource, name)
                       for r in self._rules(who, namespace))

    def check(self, authorization: str | None, verb: str, group: str, plural: str, sub: str | None,
              namespace: str | None, name: str | None) -> None:
        """Raise the API server's 403 unless the caller may do ``verb`` on the resource."""
        who = self.identify(authorization)
        if self.allows(who, verb, group, plural, sub, namespace, name):
            return
        assert who is not None
        resource = f"{plural}/{sub}" if sub else plural
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        qualified = f"{plural}.{group}" if group else plural
        subject = f'{qualified} "{name}"' if name else qualified
        raise ApiError(
            403,
            "Forbidden",
            f'{subject} is forbidden: User "{who.user}" cannot {verb} resource "{resource}" '
            f'in API group "{group}" {scope}',
            {"name": name or "", "group": group, "kind": plural},
        )
