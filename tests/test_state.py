"""Nested and optimizer state: save_state / load_state, without pickle."""
from __future__ import annotations

import builtins
import json
import math
import pickle
import sys
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fastst
from fastst import SafetensorError, load_state, save_state
from fastst.state import MAX_DEPTH, STATE_KEY, state_from_tensors, state_to_tensors


def assert_same_tree(got, expected, path="root"):
    """Same containers, key types, scalar types and values, and equal arrays."""
    if isinstance(expected, (np.ndarray, np.generic)):
        assert type(got) is type(expected), path
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        np.testing.assert_array_equal(got, expected, err_msg=path)
        return
    assert type(got) is type(expected), f"{path}: {type(got)} != {type(expected)}"
    if isinstance(expected, dict):
        assert [type(k) for k in got] == [type(k) for k in expected], path
        assert list(got) == list(expected) or all(
            _same_scalar(a, b) for a, b in zip(got, expected)), path
        for (key, value), expected_value in zip(got.items(), expected.values()):
            assert_same_tree(value, expected_value, f"{path}/{key!r}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for index, (a, b) in enumerate(zip(got, expected)):
            assert_same_tree(a, b, f"{path}/{index}")
    else:
        assert _same_scalar(got, expected), f"{path}: {got!r} != {expected!r}"


def _same_scalar(a, b):
    if type(a) is float and type(b) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) ==
                                                    math.copysign(1, b))
    return type(a) is type(b) and a == b


def roundtrip(tree, tmp_path, **kwargs):
    path = tmp_path / "state.safetensors"
    save_state(path, tree)
    return load_state(path, **kwargs)


def test_numpy_tree_round_trips_with_its_types(tmp_path):
    tree = {
        "weights": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(0)},
        0: [1, -2**63, 2**64 - 1, 2**70, -(2**80)],
        1.5: (float("nan"), float("inf"), float("-inf"), -0.0, 1e-320),
        None: {True: b"\x00\xff", False: "", b"key": None},
        "0": np.float16(3.5),
        "#": (),
        "a/b%": [[], {}, ((),)],
        "ordered": OrderedDict([("z", 1), ("a", np.ones(1))]),
    }
    assert_same_tree(roundtrip(tree, tmp_path), tree)


def test_tensor_names_are_readable_escaped_paths_any_reader_opens(tmp_path):
    tree = {"state": {0: {"exp_avg": np.ones(2)}}, "0": np.zeros(1), "a/b%c": np.zeros(1),
            "#x": np.zeros(1), None: np.zeros(1), 2.5: np.zeros(1), b"k": np.zeros(1)}
    path = tmp_path / "state.safetensors"
    save_state(path, tree)
    import safetensors.numpy
    names = sorted(safetensors.numpy.load_file(path))
    assert names == sorted(["state/0/exp_avg", "%30", "a%2Fb%25c", "%23x", "#None", "#2.5",
                            "#x6b"])


def test_int_and_str_keys_of_one_dict_get_distinct_names(tmp_path):
    tree = {0: np.zeros(1), "0": np.ones(1), -1: np.zeros(2), "-1": np.ones(2),
            None: np.zeros(3), "#None": np.ones(3), "None": np.full(1, 5)}
    path = tmp_path / "state.safetensors"
    save_state(path, tree)
    assert sorted(fastst.load_file(path)) == sorted(
        ["0", "%30", "-1", "%2D1", "#None", "%23None", "None"])
    assert_same_tree(load_state(path), tree)


def test_metadata_keeps_user_entries_and_a_versioned_tree(tmp_path):
    path = tmp_path / "state.safetensors"
    save_state(path, {"x": 1}, metadata={"format": "pt"})
    metadata = fastst.safe_open(path).metadata()
    assert metadata["format"] == "pt"
    document = json.loads(metadata[STATE_KEY])
    assert document["version"] == 1
    with pytest.raises(SafetensorError, match="reserved"):
        save_state(path, {}, metadata={STATE_KEY: "{}"})


def test_arrays_come_back_as_views_of_the_file(tmp_path):
    tree = {"a": np.arange(1000, dtype=np.int64)}
    got = roundtrip(tree, tmp_path)
    assert not got["a"].flags.owndata and got["a"].base is not None


def test_loading_runs_no_pickle_eval_or_import(tmp_path, monkeypatch):
    path = tmp_path / "state.safetensors"
    save_state(path, {"x": [np.ones(1), ("os.system", b"cposix\nsystem\n")]})

    load_state(path)     # what loading imports is imported now
    real_import = builtins.__import__
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("called")

    def import_only_loaded(name, *args, **kwargs):
        if name not in sys.modules:
            return refuse(name)
        return real_import(name, *args, **kwargs)

    for module, name in [(pickle, "loads"), (pickle, "load"), (builtins, "eval"),
                         (builtins, "exec")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(builtins, "__import__", import_only_loaded)
    try:
        got = load_state(path)
    finally:
        monkeypatch.undo()
    assert calls == []
    assert got["x"][1] == ("os.system", b"cposix\nsystem\n")


# ---------------------------------------------------------------------------
# Refused trees
# ---------------------------------------------------------------------------


def test_unstorable_leaves_and_keys_are_type_errors(tmp_path):
    path = tmp_path / "s.safetensors"
    with pytest.raises(fastst.SafetensorTypeError, match="'a/0'.*set"):
        save_state(path, {"a": [{1, 2}]})
    with pytest.raises(fastst.SafetensorTypeError, match="key of type tuple"):
        save_state(path, {(1, 2): 3})
    with pytest.raises(fastst.SafetensorTypeError, match="UTF-8"):
        save_state(path, {"\ud800": 1})


def test_cycles_and_deep_trees_are_refused_on_save(tmp_path):
    path = tmp_path / "s.safetensors"
    cyclic: list = [1]
    cyclic.append({"again": cyclic})
    with pytest.raises(SafetensorError, match="cycle"):
        save_state(path, cyclic)
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(SafetensorError, match=f"deeper than {MAX_DEPTH}"):
        save_state(path, deep)
    shared = [1]
    save_state(path, [shared, shared])          # the same object twice is no cycle
    assert load_state(path) == [[1], [1]]


def test_two_keys_with_one_tensor_name_are_refused(tmp_path):
    nan_keys = {float("nan"): np.zeros(1), float("nan"): np.ones(1)}
    assert len(nan_keys) == 2
    with pytest.raises(SafetensorError, match="two keys give this tensor name"):
        save_state(tmp_path / "s.safetensors", nan_keys)


# ---------------------------------------------------------------------------
# Hostile metadata
# ---------------------------------------------------------------------------


def hostile(tmp_path, tree_text, tensors=None, version="1"):
    path = tmp_path / "hostile.safetensors"
    text = tree_text if version is None else f'{{"version":{version},"tree":{tree_text}}}'
    fastst.save_file(tensors or {}, path, metadata={STATE_KEY: text})
    return path


@pytest.mark.parametrize("tree_text, version, match", [
    ("null", "2", "version 2 is not known"),
    ("null", '"1"', "version '1' is not known"),
    ("null", "true", "version True is not known"),
    ('{"a":1}', None, "must be an object of 'version' and 'tree'"),
    ("[1", None, "not valid JSON"),
    ('{"list":[1]', "1", "not valid JSON"),
    ('[1,2]', "1", "bare JSON array"),
    ('{"list":1}', "1", "must hold a JSON array"),
    ('{"list":[],"tuple":[]}', "1", "object of one key"),
    ('{"set":[]}', "1", "unknown node 'set'"),
    ('{"float":"1.5"}', "1", "holds 'nan', 'inf' or '-inf'"),
    ('{"float":1}', "1", "must hold a string"),
    ('{"int":"12a"}', "1", "decimal digits"),
    ('{"int":"' + "9" * 5000 + '"}', "1", "decimal digits"),
    ('{"bytes":"!!"}', "1", "base64"),
    ('{"dict":[[1]]}', "1", r"\[key, value\] pair"),
    ('{"dict":[[{"list":[]},1]]}', "1", "key must be a scalar"),
    ('{"dict":[[{"tensor":"a"},1]]}', "1", "key must be a scalar"),
    ('{"dict":[[1,2],[1.0,3]]}', "1", "key 1.0 is given twice"),
    ('{"dict":[["k",2],["k",3]]}', "1", "key 'k' is given twice"),
    ('{"tensor":"missing"}', "1", "tensor 'missing' is not in the file"),
    ('{"tensor":5}', "1", "tensor 5 is not in the file"),
])
def test_hostile_metadata_is_a_clear_error(tmp_path, tree_text, version, match):
    path = hostile(tmp_path, tree_text, version=version)
    with pytest.raises(SafetensorError, match=match) as caught:
        load_state(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("tree_text, version, twice", [
    ('{"list":[1],"list":[2]}', "1", "list"),
    ('{"list":[1],"\\u006cist":[2]}', "1", "list"),
    ('{"dict":[["a",{"int":"1","int":"2"}]]}', "1", "int"),
    ('{"tuple":[{"list":[{"float":"nan","float":"inf"}]}]}', "1", "float"),
    ('{"version":1,"tree":{"list":[1]},"tree":{"list":[2]}}', None, "tree"),
    ('{"version":1,"tree":{"list":["a,\\"b\\"{"]},"version":1}', None, "version"),
])
def test_a_key_given_twice_in_the_tree_is_refused(tmp_path, tree_text, version, twice):
    path = hostile(tmp_path, tree_text, version=version)
    with pytest.raises(SafetensorError, match=f"{path}: metadata 'fastst.state' gives the key "
                                              f"'{twice}' twice in one object"):
        load_state(path)


def test_keys_alike_in_different_objects_are_not_given_twice(tmp_path):
    path = hostile(tmp_path, '{"list":[{"list":[{"dict":[["list",{"list":[]}]]}]},'
                             '{"list":["{\\"list\\":1,\\"list\\":2}"]}]}')
    assert load_state(path) == [[{"list": []}], ['{"list":1,"list":2}']]


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_scalar_node_over_a_tensor_with_axes_is_refused(tmp_path, framework):
    if framework == "pt":
        pytest.importorskip("torch")
    path = hostile(tmp_path, '{"dict":[["lr",{"scalar":"m"}]]}', {"m": np.zeros((2, 3))})
    with pytest.raises(SafetensorError, match=r"at 'lr': a scalar node names tensor 'm' of "
                                              r"shape \[2, 3\]; a scalar's tensor has shape"):
        load_state(path, framework)
    path = hostile(tmp_path, '{"dict":[["lr",{"scalar":"m"}]]}', {"m": np.float32(0.5)})
    assert float(load_state(path, framework)["lr"]) == 0.5


def test_leaves_that_collide_on_one_tensor_are_refused(tmp_path):
    path = hostile(tmp_path, '{"dict":[["a",{"tensor":"t"}],["b",{"tensor":"t"}]]}',
                   {"t": np.zeros(1)})
    with pytest.raises(SafetensorError, match=r"at 'b': tensor 't' is used twice"):
        load_state(path)


def test_a_tensor_the_tree_leaves_out_is_refused(tmp_path):
    path = hostile(tmp_path, '{"list":[]}', {"stray": np.zeros(1)})
    with pytest.raises(SafetensorError, match="'stray' is in the file but not in the state"):
        load_state(path)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 10_000])
def test_deep_metadata_is_refused_without_recursion(tmp_path, depth):
    path = hostile(tmp_path, '{"list":[' * depth + "]}" * depth)
    with pytest.raises(SafetensorError, match="deeper than|not valid JSON"):
        load_state(path)


def test_a_plain_file_is_not_a_state_file(tmp_path):
    path = tmp_path / "plain.safetensors"
    fastst.save_file({"a": np.zeros(1)}, path)
    with pytest.raises(SafetensorError, match="not a state file"):
        load_state(path)


def test_the_seam_is_flat_tensors_and_metadata():
    tree = {"a": [np.ones(2), 3]}
    tensors, metadata = state_to_tensors(tree)
    assert list(tensors) == ["a/0"]
    rebuilt = state_from_tensors(metadata, tensors.__getitem__, tensors)
    assert_same_tree(rebuilt, tree)


# ---------------------------------------------------------------------------
# Random trees
# ---------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text()
           | st.binary(max_size=8))
keys = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
        | st.text(max_size=6) | st.binary(max_size=4))
arrays = st.builds(lambda n, kind: (np.arange(n) % 3).astype(kind), st.integers(0, 4),
                   st.sampled_from([np.float32, np.int8, np.uint64, np.bool_]))
trees = st.recursive(
    scalars | arrays,
    lambda children: (st.lists(children, max_size=4)
                      | st.lists(children, max_size=4).map(tuple)
                      | st.dictionaries(keys, children, max_size=4)),
    max_leaves=20)


@settings(max_examples=60, deadline=None)
@given(tree=trees)
def test_random_trees_round_trip(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("state") / "s.safetensors"
    save_state(path, tree)
    assert_same_tree(load_state(path), tree)


# ---------------------------------------------------------------------------
# Optimizers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda torch, params: torch.optim.AdamW(params, lr=0.01, betas=(0.8, 0.95)),
    lambda torch, params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
], ids=["AdamW", "SGD"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded"])
def test_torch_optimizer_state_reloads_and_steps_identically(tmp_path, make, sharded):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    optimizer = make(torch, model.parameters())
    data = torch.randn(8, 4)

    def step(model, optimizer):
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()

    for _ in range(3):
        step(model, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if sharded:
        path = tmp_path / "checkpoint"
        save_state(path, state, max_shard_size=64, checksum="xxh3_64")
        assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
        loaded = load_state(path, framework="pt", verify=True)
    else:
        path = tmp_path / "optimizer.safetensors"
        save_state(path, state)
        loaded = load_state(path, framework="pt")
    assert isinstance(loaded["optimizer"]["state"][0], dict)     # int keys stay int
    assert isinstance(loaded["optimizer"]["state"][0][next(iter(loaded["optimizer"]["state"][0]))],
                      torch.Tensor)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    twin.load_state_dict(loaded["model"])
    twin_optimizer = make(torch, twin.parameters())
    twin_optimizer.load_state_dict(loaded["optimizer"])
    for _ in range(2):
        step(model, optimizer)
        step(twin, twin_optimizer)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert_same_tree(load_state(path)["optimizer"]["param_groups"],
                     optimizer.state_dict()["param_groups"])


def test_optax_state_reloads_and_steps_identically(tmp_path):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.zeros(3)}}
    optimizer = optax.adamw(0.01)

    def step(params, opt_state):
        grads = jax.tree_util.tree_map(lambda p: p * 0.5 + 1.0, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = optimizer.init(params)
    for _ in range(3):
        params, opt_state = step(params, opt_state)
    # optax states are NamedTuples: their leaves are saved, and the fresh state's
    # tree structure puts them back (no class is named in the file)
    train_state = {"step": 3, "params": params,
                   "opt_state": jax.tree_util.tree_leaves(opt_state)}
    path = tmp_path / "train.safetensors"
    save_state(path, train_state)

    loaded = load_state(path, framework="jax")
    assert loaded["step"] == 3 and isinstance(loaded["params"]["dense"]["bias"], jax.Array)
    structure = jax.tree_util.tree_structure(optimizer.init(loaded["params"]))
    restored = jax.tree_util.tree_unflatten(structure, loaded["opt_state"])
    new_params, _ = step(params, opt_state)
    twin_params, _ = step(loaded["params"], restored)
    for a, b in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(twin_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_optax_state_is_refused_with_the_way_to_save_it(tmp_path):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")

    opt_state = optax.adam(0.01).init({"w": jax.numpy.zeros(3)})
    with pytest.raises(fastst.SafetensorTypeError) as refused:
        save_state(tmp_path / "train.safetensors", {"step": 3, "opt_state": opt_state})
    assert str(refused.value) == (
        "state tree at 'opt_state/0': a NamedTuple (optax._src.transform.ScaleByAdamState) "
        "cannot be stored: an optax state is made of them; save its leaves, "
        "jax.tree_util.tree_leaves(opt_state), and put them back with "
        "jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(optimizer.init(params)), "
        "leaves)")


def test_a_sharded_state_keeps_its_tree_in_the_index_and_loads_lazily(tmp_path):
    tree = {"layers": [{"w": np.full((8, 8), k, np.float32), "scale": 0.5 * k}
                       for k in range(4)], "step": 7, "name": "run"}
    folder = tmp_path / "state"
    save_state(folder, tree, {"note": "kept"}, max_shard_size=300)
    shards = sorted(folder.glob("*-of-*.safetensors"))
    assert len(shards) == 4
    index = json.loads((folder / "model.safetensors.index.json").read_bytes())
    assert STATE_KEY in index["metadata"] and index["metadata"]["note"] == "kept"
    assert all(STATE_KEY not in (fastst.safe_open(shard).metadata() or {}) for shard in shards)
    shards[-1].unlink()
    with pytest.raises(SafetensorError, match="shard 'model-00004-of-00004.safetensors' is "
                                              "missing"):
        load_state(folder / "model.safetensors.index.json")
    save_state(folder, tree, {"note": "kept"}, max_shard_size=300)
    assert_same_tree(load_state(folder), tree)


def test_a_sharded_state_that_fits_in_one_file_is_one_file(tmp_path):
    tree = {"w": np.arange(4.0), "step": 1}
    save_state(tmp_path / "state.safetensors", tree, max_shard_size="1MB")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["state.safetensors"]
    assert_same_tree(load_state(tmp_path), tree)
    assert_same_tree(load_state(tmp_path / "state.safetensors"), tree)
