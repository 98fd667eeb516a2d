"""Pure pieces of the emulator: patches, quantities, path rewriting, $(VAR) expansion."""

from __future__ import annotations

from fractions import Fraction

import pytest

from tests.kubeemu import quantity
from tests.kubeemu.kubelet import expand
from tests.kubeemu.patch import PatchError, json_patch, merge_patch, strategic_merge_patch


def test_merge_patch_replaces_lists_and_deletes_nulls():
    doc = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert merge_patch(doc, {"a": {"b": None, "d": 3}, "l": [3]}) == {"a": {"c": 2, "d": 3},
                                                                     "l": [3]}
    assert doc == {"a": {"b": 1, "c": 2}, "l": [1, 2]}  # input untouched


def test_strategic_merge_merges_named_lists_and_honours_directives():
    pod = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}],
                    "tolerations": [{"key": "x"}]},
           "metadata": {"finalizers": ["f1"]}}
    out = strategic_merge_patch(pod, {
        "spec": {"containers": [{"name": "b", "image": "2"}, {"name": "c", "image": "3"}],
                 "tolerations": [{"key": "y"}]},
        "metadata": {"finalizers": ["f2"]}})
    assert [(c["name"], c["image"]) for c in out["spec"]["containers"]] == [
        ("a", "1"), ("b", "2"), ("c", "3")]
    assert out["spec"]["tolerations"] == [{"key": "y"}]  # no merge key: replaced
    assert out["metadata"]["finalizers"] == ["f1", "f2"]  # set-like primitive list
    deleted = strategic_merge_patch(out, {"spec": {"containers": [
        {"name": "a", "$patch": "delete"}]}})
    assert [c["name"] for c in deleted["spec"]["containers"]] == ["b", "c"]
    pruned = strategic_merge_patch(out, {"metadata": {"$deleteFromPrimitiveList/finalizers":
                                                      ["f1"]}})
    assert pruned["metadata"]["finalizers"] == ["f2"]


def test_json_patch_operations_and_failures():
    doc = {"metadata": {"labels": {"a": "1"}}, "items": [1, 2]}
    out = json_patch(doc, [
        {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
        {"op": "remove", "path": "/metadata/labels/a"},
        {"op": "add", "path": "/items/-", "value": 3},
        {"op": "replace", "path": "/items/0", "value": 0},
        {"op": "copy", "from": "/items/2", "path": "/copied"},
        {"op": "move", "from": "/copied", "path": "/moved"},
        {"op": "test", "path": "/moved", "value": 3},
    ])
    assert out == {"metadata": {"labels": {"b/c": "2"}}, "items": [0, 2, 3], "moved": 3}
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "remove", "path": "/nope"}])
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "test", "path": "/items/0", "value": 9}])


@pytest.mark.parametrize(("text", "value"), [
    ("1", Fraction(1)), ("100m", Fraction(1, 10)), ("1Gi", Fraction(2**30)),
    ("1.5", Fraction(3, 2)), ("2k", Fraction(2000)), ("1e3", Fraction(1000)), (2, Fraction(2)),
])
def test_quantities(text, value):
    assert quantity.parse(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1 Gi", "1Q"])
def test_bad_quantities(text):
    with pytest.raises(quantity.QuantityError):
        quantity.parse(text)


def test_dependent_variable_expansion():
    env = {"A": "x", "B": "y"}
    assert expand("$(A)-$(B)", env) == "x-y"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("$(MISSING)", env) == "$(MISSING)"
