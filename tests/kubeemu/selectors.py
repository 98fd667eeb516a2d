"""Label and field selectors with the syntax and semantics of k8s.io/apimachinery."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ApiError, bad_request
from .validation import label_key_errors, label_value_errors

LabelMatcher = Callable[[Mapping[str, str]], bool]


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return has and value in self.values
        if self.op in ("!=", "notin"):
            return not has or value not in self.values
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("gt", "lt"):
            if not has:
                return False
            try:
                lhs, rhs = int(value), int(self.values[0])
            except (TypeError, ValueError):
                return False
            return lhs > rhs if self.op == "gt" else lhs < rhs
        raise AssertionError(self.op)


_TOKEN = re.compile(r"\s*(!=|==|=|!|\(|\)|,|>|<|[^\s!=(),<>]+)")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            break
        out.append(m.group(1))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


def _fail(text: str, why: str) -> ApiError:
    return bad_request(f"unable to parse requirement: {why}" if why else
                       f"couldn't parse the selector string \"{text}\"")


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse a labelSelector query string; raises ApiError(400) like the API server."""
    if not text or not text.strip():
        return []
    toks = _tokens(text)
    reqs: list[Requirement] = []
    i = 0

    def check(key: str, values: Iterable[str]) -> None:
        errs = label_key_errors(key)
        if errs:
            raise _fail(text, f'key: Invalid value: "{key}": {errs[0]}')
        for v in values:
            verrs = label_value_errors(v)
            if verrs:
                raise _fail(text, f'values[0][{key}]: Invalid value: "{v}": {verrs[0]}')

    while i < len(toks):
        if toks[i] == "!":
            if i + 1 >= len(toks):
                raise _fail(text, "found '', expected: identifier")
            key = toks[i + 1]
            check(key, ())
            reqs.append(Requirement(key, "!"))
            i += 2
        else:
            key = toks[i]
            if key in ("=", "==", "!=", "(", ")", ",", "<", ">"):
                raise _fail(text, f"found '{key}', expected: !, identifier, or 'end of string'")
            i += 1
            if i >= len(toks) or toks[i] == ",":
                check(key, ())
                reqs.append(Requirement(key, "exists"))
            elif toks[i] in ("=", "==", "!="):
                op = "!=" if toks[i] == "!=" else "="
                i += 1
                value = ""
                if i < len(toks) and toks[i] != ",":
                    value = toks[i]
                    i += 1
                check(key, [value])
                reqs.append(Requirement(key, op, (value,)))
            elif toks[i] in (">", "<"):
                op = "gt" if toks[i] == ">" else "lt"
                i += 1
                if i >= len(toks) or not re.fullmatch(r"-?\d+", toks[i]):
                    raise _fail(text, "for 'Gt', 'Lt' operators, the value must be an integer")
                reqs.append(Requirement(key, op, (toks[i],)))
                i += 1
            elif toks[i].lower() in ("in", "notin"):
                op = toks[i].lower()
                i += 1
                if i >= len(toks) or toks[i] != "(":
                    raise _fail(text, f"found '{toks[i] if i < len(toks) else ''}', expected: '('")
                i += 1
                values: list[str] = []
                expect_value = True
                while i < len(toks) and toks[i] != ")":
                    if toks[i] == ",":
                        if expect_value:
                            values.append("")
                        expect_value = True
                    else:
                        values.append(toks[i])
                        expect_value = False
                    i += 1
                if i >= len(toks):
                    raise _fail(text, "found '', expected: ')'")
                i += 1  # ")"
                check(key, values)
                reqs.append(Requirement(key, op, tuple(values)))
            else:
                raise _fail(text, f"found '{toks[i]}', expected: in, notin, =, ==, !=, gt, lt")
        if i < len(toks):
            if toks[i] != ",":
                raise _fail(text, f"found '{toks[i]}', expected: ',' or 'end of string'")
            i += 1
    return reqs


def label_matcher(text: str | None) -> LabelMatcher:
    reqs = parse_label_selector(text)
    return lambda labels: all(r.matches(labels or {}) for r in reqs)


def matches_selector_object(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector object (matchLabels + matchExpressions)."""
    if selector is None:
        return True
    labels = labels or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        op = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!",
              "Gt": "gt", "Lt": "lt"}.get(expr.get("operator"), "in")
        if not Requirement(expr["key"], op, tuple(expr.get("values") or ())).matches(labels):
            return False
    return True


# ------------------------------------------------------------------------------ field selectors


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    op: str  # "=" or "!="
    value: str


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, cur, i = [], [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur.append(text[i:i + 2])
            i += 2
            continue
        if c == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_field_selector(text: str | None, allowed: Iterable[str]) -> list[FieldRequirement]:
    if not text or not text.strip():
        return []
    allowed = set(allowed)
    reqs = []
    for part in _split_unescaped(text, ","):
        if not part:
            continue
        m = re.match(r"^((?:[^\\=!]|\\.)*?)(!=|==|=)(.*)$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        field, op, value = m.group(1).strip(), m.group(2), _unescape(m.group(3))
        if field not in allowed:
            raise bad_request(f'field label not supported: {field}')
        reqs.append(FieldRequirement(field, "!=" if op == "!=" else "=", value))
    return reqs


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string the API server compares a field selector against."""
    if path == "source":  # core Event: source.component
        path = "source.component"
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            cur = None
            break
        cur = cur.get(part)
    if path == "status.podIPs":
        cur = ",".join(p.get("ip", "") for p in (cur or []))
    if cur is None:
        return "false" if path in ("spec.unschedulable", "spec.hostNetwork") else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def field_matcher(text: str | None, allowed: Iterable[str]) -> Callable[[Mapping], bool]:
    reqs = parse_field_selector(text, allowed)

    def match(obj: Mapping) -> bool:
        for r in reqs:
            v = field_value(obj, r.field)
            if r.field == "status.podIPs":
                hit = r.value in v.split(",")
            else:
                hit = v == r.value
            if hit != (r.op == "="):
                return False
        return True

    return match
