"""Loading the admission config and the inventory: valid input loads, bad input names the key."""

import pytest
import yaml

from quotas import ConfigError, Limits, Mode, load_config, load_pool, parse_simulated

TEAM_EXAMPLE = """
priority_classes:
  high:    {value: 1000, preempt: true,  borrow: false}
  default: {value: 100,  preempt: false, borrow: false}
  low:     {value: 10,   preempt: false, borrow: true}
default_priority_class: default
placement: {node: binpack, gpu: binpack}
workspaces:
  default:
    limits: {memory_mib: 163840, cores_percent: 400, gpus: 8}
    namespaces:
      default:
        limits: {memory_mib: 81920}
        user_limits: {memory_mib: 40960, gpus: 2}
        users:
          alice: {memory_mib: 20480}
"""


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data)
    return info.value.message


def test_the_documented_example_loads():
    cfg = load_config(yaml.safe_load(TEAM_EXAMPLE))
    assert cfg.default_priority_class == "default"
    assert cfg.priority_classes["high"].preempt and cfg.priority_classes["low"].borrow
    assert cfg.placement.node == "binpack"
    ws = cfg.workspaces["default"]
    assert ws.limits == Limits(163840, 400, 8)
    ns = ws.namespaces["default"]
    assert ns.limits == Limits(memory_mib=81920)


def test_a_user_entry_overrides_the_namespace_default_key_by_key():
    ns = load_config(yaml.safe_load(TEAM_EXAMPLE)).workspaces["default"].namespaces["default"]
    assert ns.limits_for("alice") == Limits(memory_mib=20480, gpus=2)
    assert ns.limits_for("bob") == Limits(memory_mib=40960, gpus=2)


def test_an_empty_config_gives_three_classes_and_one_unlimited_workspace():
    cfg = load_config({})
    assert set(cfg.priority_classes) == {"high", "default", "low"}
    assert cfg.default_priority_class == "default"
    assert cfg.workspaces["default"].namespaces["default"].limits_for("x").unlimited
    assert load_config(None) == cfg


def test_a_workspace_without_namespaces_gets_a_default_namespace():
    cfg = load_config({"workspaces": {"vision": {"limits": {"gpus": 4}}}})
    assert list(cfg.workspaces["vision"].namespaces) == ["default"]


def test_a_bad_limit_names_its_key_path_and_what_is_allowed():
    message = error_of({"workspaces": {"vision": {"limits": {"memory_mib": "abc"}}}})
    assert message == "workspaces.vision.limits.memory_mib: must be an integer > 0, got 'abc'"
    message = error_of({"workspaces": {"v": {"namespaces": {"ml": {"users": {"al": {"gpus": 0}}}}}}})
    assert message == "workspaces.v.namespaces.ml.users.al.gpus: must be an integer > 0, got 0"
    assert "got True" in error_of({"workspaces": {"v": {"limits": {"gpus": True}}}})


def test_null_limits_mean_unlimited():
    cfg = load_config({"workspaces": {"v": {"limits": {"memory_mib": None}}}})
    assert cfg.workspaces["v"].limits.unlimited


@pytest.mark.parametrize(
    "data, path, allowed",
    [
        ({"workspace": {}}, "workspace", "priority_classes, default_priority_class"),
        ({"workspaces": {"v": {"limts": {}}}}, "workspaces.v.limts", "limits, namespaces"),
        ({"workspaces": {"v": {"limits": {"memory": 1}}}}, "workspaces.v.limits.memory",
         "memory_mib, cores_percent, gpus"),
        ({"priority_classes": {"x": {"value": 1, "prempt": True}}}, "priority_classes.x.prempt",
         "value, preempt, borrow"),
        ({"placement": {"nodes": "spread"}}, "placement.nodes", "node, gpu"),
        ({"workspaces": {"v": {"namespaces": {"n": {"user_limit": {}}}}}},
         "workspaces.v.namespaces.n.user_limit", "limits, user_limits, users"),
    ],
)
def test_an_unknown_key_is_an_error_naming_it_and_the_allowed_keys(data, path, allowed):
    message = error_of(data)
    assert message.startswith(f"{path}: unknown key; allowed keys: ")
    assert allowed in message


def test_priority_classes_are_checked():
    assert error_of({"priority_classes": {"x": {"preempt": True}}}) == (
        "priority_classes.x.value: is required (an integer; higher wins)"
    )
    assert "must be true or false, got 'yes'" in error_of(
        {"priority_classes": {"x": {"value": 1, "borrow": "yes"}}}
    )
    assert error_of({"priority_classes": {}}).startswith("priority_classes: must define")


def test_the_default_priority_class_must_be_defined():
    message = error_of({"default_priority_class": "urgent"})
    assert message.startswith("default_priority_class: names no defined priority class")
    assert "high, default, low" in message
    message = error_of({"priority_classes": {"a": {"value": 1}, "b": {"value": 2}}})
    assert message.startswith("default_priority_class: is required")
    one = load_config({"priority_classes": {"only": {"value": 5}}})
    assert one.default_priority_class == "only"


def test_placement_must_be_binpack_spread_or_fgd():
    assert error_of({"placement": {"node": "random"}}) == (
        "placement.node: must be one of binpack, spread, fgd, got 'random'"
    )
    assert load_config({"placement": {"gpu": "spread"}}).placement.gpu == "spread"


def test_structure_errors_name_the_key():
    assert error_of({"workspaces": ["a"]}) == "workspaces: must be a mapping, got a list"
    assert error_of(["a"]).startswith("the admission config must be a mapping")
    assert error_of({"workspaces": {"v": {"namespaces": {}}}}).startswith(
        "workspaces.v.namespaces: must define at least one namespace"
    )


def test_the_preemption_bound_is_configurable():
    cfg = load_config({"preemption": {"max_candidate_nodes": 7}})
    assert cfg.policy.max_preemption_nodes == 7
    assert "preemption.max_candidate_nodes: must be an integer > 0" in error_of(
        {"preemption": {"max_candidate_nodes": 0}}
    )


# ---- inventory ------------------------------------------------------------------------------


def test_a_list_of_nodes_loads_with_defaults():
    p = load_pool([{"name": "n1", "gpus": [
        {"uuid": "GPU-1", "model": "H100-80GB", "memory_mib": 81920},
        {"uuid": "GPU-2", "model": "H100-80GB", "memory_mib": 81920, "mode": "whole",
         "memory_oversub": 1.5, "index": 5},
    ]}])
    g1, g2 = p.node("n1").gpus
    assert (g1.mode, g1.memory_oversub, g1.cores_oversub, g1.index, g1.sm_count) == (
        Mode.SHARED, 1.0, 1.0, 0, 0)
    assert (g2.mode, g2.memory_oversub, g2.index) == (Mode.WHOLE, 1.5, 5)


def test_node_level_mode_and_oversubscription_apply_to_its_gpus():
    p = load_pool({"nodes": {"n1": {"mode": "whole", "cores_oversub": 2, "gpus": [
        {"uuid": "a", "model": "A100", "memory_mib": 40960},
        {"uuid": "b", "model": "A100", "memory_mib": 40960, "mode": "shared"},
    ]}}})
    a, b = p.node("n1").gpus
    assert (a.mode, a.cores_oversub) == (Mode.WHOLE, 2.0)
    assert (b.mode, b.cores_oversub) == (Mode.SHARED, 2.0)


def test_a_pool_round_trips_through_its_dict_form():
    p = parse_simulated("2xH100-80GB,1xA100-40GB")
    assert load_pool(p.to_dict()) == p


@pytest.mark.parametrize(
    "data, message",
    [
        ([{"gpus": []}], "nodes[0].name: is required"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m"}]}],
         "nodes[0].gpus[0].memory_mib: is required"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": -5}]}],
         "nodes[0].gpus[0].memory_mib: must be an integer > 0, got -5"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5, "mode": "vgpu"}]}],
         "nodes[0].gpus[0].mode: must be one of shared, whole, mig, got 'vgpu'"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5,
                                  "memory_oversub": 0}]}],
         "nodes[0].gpus[0].memory_oversub: must be a number > 0"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5,
                                  "mig_profiles": ["1g.10gb"]}]}],
         "nodes[0].gpus[0].mig_profiles: only allowed with mode 'mig'"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5, "colour": 1}]}],
         "nodes[0].gpus[0].colour: unknown key; allowed keys: uuid, model, memory_mib"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5}]},
          {"name": "o", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5}]}],
         "nodes[1].gpus[0]: GPU uuid 'a' appears twice in the pool"),
        ([{"name": "n", "gpus": []}, {"name": "n", "gpus": []}], "nodes[1]: node 'n' appears twice"),
        ([{"name": "n", "gpus": [{"uuid": "a", "model": "m", "memory_mib": 5},
                                 {"uuid": "b", "model": "m", "memory_mib": 5, "index": 0}]}],
         "nodes[0].gpus[1].index: is used by two GPUs of the same node, got 0"),
        ({"nodez": []}, "nodez: unknown key; allowed keys: nodes, simulated"),
        ([{"name": "n", "gpus": {"uuid": "a"}}], "nodes[0].gpus: must be a list of GPUs"),
        (42, "the GPU inventory must be a list of nodes or a mapping"),
    ],
)
def test_a_bad_inventory_names_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        load_pool(data)
    assert info.value.message.startswith(message), info.value.message


def test_a_mig_gpu_lists_its_profiles():
    p = load_pool([{"name": "n", "gpus": [{"uuid": "a", "model": "A100", "memory_mib": 40960,
                                           "mode": "mig", "mig_profiles": ["3g.20gb", "3g.20gb"]}]}])
    assert p.gpu("a").mig_profiles == ("3g.20gb", "3g.20gb")


def test_simulated_gpus_are_parsed_onto_one_local_node():
    p = parse_simulated("2xH100-80GB, 1xA100-40GB")
    (n,) = p.nodes
    assert n.name == "localhost"
    assert [(g.model, g.memory_mib, g.index) for g in n.gpus] == [
        ("H100-80GB", 81920, 0), ("H100-80GB", 81920, 1), ("A100-40GB", 40960, 2)]
    assert all(g.uuid.startswith("GPU-sim-") for g in n.gpus)
    assert len({g.uuid for g in n.gpus}) == 3
    assert n.gpus[0].sm_count == 132
    assert parse_simulated("1xT4").nodes[0].gpus[0].memory_mib == 16 * 1024
    assert load_pool({"simulated": "1xL4"}).nodes[0].gpus[0].memory_mib == 24 * 1024


@pytest.mark.parametrize("spec, part", [
    ("", "expected COUNTxMODEL-SIZE"),
    ("twoxH100", "'twoxH100' is not COUNTxMODEL-SIZE"),
    ("2xMystery", "'2xMystery' has no memory size"),
    ("0xH100-80GB", "the count must be 1 to 64"),
])
def test_a_bad_simulated_spec_says_what_is_expected(spec, part):
    with pytest.raises(ConfigError) as info:
        parse_simulated(spec)
    assert part in info.value.message
