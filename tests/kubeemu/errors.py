"""Errors rendered exactly as the Kubernetes API server renders them: a ``Status`` object.

The bodies follow ``k8s.io/apimachinery/pkg/api/errors`` (NewNotFound, NewAlreadyExists,
NewConflict, NewInvalid, NewBadRequest, NewForbidden, NewResourceExpired, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Go's field.ErrorType strings and the cause reasons they map to.
_CAUSE_REASONS = {
    "Required value": "FieldValueRequired",
    "Invalid value": "FieldValueInvalid",
    "Unsupported value": "FieldValueNotSupported",
    "Duplicate value": "FieldValueDuplicate",
    "Forbidden": "FieldValueForbidden",
    "Not found": "FieldValueNotFound",
    "Too long": "FieldValueTooLong",
    "Too many": "FieldValueTooMany",
}


def go_quote(value: Any) -> str:
    """Render a value the way Go's ``%q``/``%v`` does in field errors."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


@dataclass
class FieldError:
    """One entry of an Invalid error (``field.Error`` in Go)."""

    field: str
    type: str  # one of the keys of _CAUSE_REASONS
    value: Any = None
    detail: str = ""
    has_value: bool = False

    def body(self) -> str:
        text = self.type
        if self.has_value and self.type in ("Invalid value", "Unsupported value",
                                            "Duplicate value", "Not found"):
            text += ": " + go_quote(self.value)
        if self.detail:
            text += ": " + self.detail
        return text

    def message(self) -> str:
        return f"{self.field}: {self.body()}"

    def cause(self) -> dict:
        return {"reason": _CAUSE_REASONS.get(self.type, "FieldValueInvalid"),
                "message": self.body(), "field": self.field}


def required(path: str, detail: str = "") -> FieldError:
    return FieldError(path, "Required value", detail=detail)


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError(path, "Invalid value", value, detail, has_value=True)


def not_supported(path: str, value: Any, supported: list[str]) -> FieldError:
    detail = "supported values: " + ", ".join(go_quote(s) for s in supported)
    return FieldError(path, "Unsupported value", value, detail, has_value=True)


def duplicate(path: str, value: Any) -> FieldError:
    return FieldError(path, "Duplicate value", value, has_value=True)


def forbidden(path: str, detail: str) -> FieldError:
    return FieldError(path, "Forbidden", detail=detail)


def field_not_found(path: str, value: Any) -> FieldError:
    return FieldError(path, "Not found", value, has_value=True)


@dataclass
class ApiError(Exception):
    """An API failure; ``status()`` is the ``Status`` body the real server would send."""

    code: int
    reason: str
    message: str
    details: dict | None = field(default=None)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                "status": "Failure", "message": self.message,
                                "reason": self.reason}
        if self.details is not None:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _details(name: str, group: str, kind: str, **extra: Any) -> dict:
    d: dict[str, Any] = {"name": name}
    if group:
        d["group"] = group
    d["kind"] = kind
    d.update(extra)
    return d


def qualified(plural: str, group: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(plural: str, group: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(plural, group)} "{name}" not found',
                    _details(name, group, plural))


def already_exists(plural: str, group: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{qualified(plural, group)} "{name}" already exists',
                    _details(name, group, plural))


def conflict(plural: str, group: str, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict",
                    f'Operation cannot be fulfilled on {qualified(plural, group)} "{name}": {why}',
                    _details(name, group, plural))


CONFLICT_MODIFIED = ("the object has been modified; please apply your changes to the latest "
                     "version and try again")


def invalid_object(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    if len(errors) == 1:
        text = errors[0].message()
    else:
        text = "[" + ", ".join(e.message() for e in errors) + "]"
    qkind = f"{kind}.{group}" if group else kind
    return ApiError(422, "Invalid", f'{qkind} "{name}" is invalid: {text}',
                    _details(name, group, kind, causes=[e.cause() for e in errors]))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def forbidden_error(plural: str, group: str, name: str, why: str) -> ApiError:
    return ApiError(403, "Forbidden", f'{qualified(plural, group)} "{name}" is forbidden: {why}',
                    _details(name, group, plural))


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def unknown_route() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed",
                    "the server does not allow this method on the requested resource", {})


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, "UnsupportedMediaType",
                    f'the body of the request was in an unknown format - accepted media types '
                    f'include: application/json-patch+json, application/merge-patch+json, '
                    f'application/apply-patch+yaml, application/strategic-merge-patch+json '
                    f'(got "{content_type}")')
