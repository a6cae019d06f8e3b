"""Grid expansion, presets, config files and variant specs."""
from __future__ import annotations

import json

import pytest

from bench.grid import ConfigError, build_grid, load_config, preset_names
from bench.mods import VariantError, eval_param, resolve, split_terms


def test_anchors_preset_is_the_anchors_grid():
    grid = build_grid(load_config("anchors"), "anchors")
    full = [c for c in grid.cases if c.pass_ != "decode"]
    decode = [c for c in grid.cases if c.pass_ == "decode"]
    # 7 variants × 2 shapes × 2 passes, and 3 decode variants × 2 KV lengths.
    assert len(full) == 28 and len(decode) == 6
    assert {(c.batch, c.q_len) for c in full} == {(4, 4096), (1, 16384)}
    assert all(c.q_heads == 16 and c.head_dim == 128 and c.dtype == "bfloat16" for c in full)
    assert {(c.batch, c.q_heads, c.kv_heads, c.q_len, c.kv_len) for c in decode} == {
        (8, 32, 8, 1, 8192), (8, 32, 8, 1, 65536)}
    assert "torch_flex" in grid.providers and "flexlab" in grid.providers


def test_filters_keep_only_requested_passes_and_variants():
    grid = build_grid(load_config("anchors"), "anchors", passes=["forward"], variants=["causal"])
    assert {c.pass_ for c in grid.cases} == {"fwd"} and {c.variant for c in grid.cases} == {"causal"}


def test_every_preset_expands():
    for name in preset_names():
        assert build_grid(load_config(name), name).cases


def test_toml_and_yaml_configs_give_the_same_grid(tmp_path):
    toml = tmp_path / "g.toml"
    toml.write_text('providers = ["sdpa_math"]\n[settings]\ncpu_reps = 1\n[[groups]]\n'
                    'variants = ["causal"]\nshapes = [[2, 64], [1, 32, 96]]\nheads = [[4, 2]]\n'
                    'head_dim = [16, [16, 8]]\ndtype = ["fp32"]\npasses = ["forward+backward"]\n')
    yaml = tmp_path / "g.yaml"
    yaml.write_text("providers: [sdpa_math]\nsettings: {cpu_reps: 1}\ngroups:\n"
                    "  - variants: [causal]\n    shapes: [[2, 64], [1, 32, 96]]\n    heads: [[4, 2]]\n"
                    "    head_dim: [16, [16, 8]]\n    dtype: [fp32]\n    passes: [forward+backward]\n")
    a, b = build_grid(load_config(toml)), build_grid(load_config(yaml))
    assert [c.case_id for c in a.cases] == [c.case_id for c in b.cases]
    assert len(a.cases) == 4 and a.settings.cpu_reps == 1
    assert {(c.q_len, c.kv_len, c.v_head_dim) for c in a.cases} == {
        (64, 64, 16), (64, 64, 8), (32, 96, 16), (32, 96, 8)}
    assert all(c.pass_ == "fwd_bwd" and c.kv_heads == 2 for c in a.cases)


@pytest.mark.parametrize("config, words", [
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [3], "kv_heads": [2],
                  "head_dim": [8]}], "providers": ["sdpa_math"]}, "multiple"),
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8],
                  "dtype": ["int8"]}], "providers": ["sdpa_math"]}, "dtype"),
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8],
                  "colour": 1}], "providers": ["sdpa_math"]}, "colour"),
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8]}]},
     "providers"),
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8]}],
      "providers": ["sdpa_math"], "settings": {"cuda_graphs": "decode,backward"}}, "cuda_graphs"),
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8]}],
      "providers": ["sdpa_math"], "settings": {"pin_host": "no"}}, "pin_host='no': expected true or false"),
    ({"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8]}],
      "providers": ["sdpa_math"], "settings": {"rounds": 0}}, r"rounds=0: expected an integer in \[1, 100\]"),
])
def test_bad_configs_say_what_is_wrong(config, words):
    with pytest.raises(ConfigError, match=words):
        build_grid(config)


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="preset"):
        load_config("no-such-preset")


def test_variant_spec_grammar():
    terms = split_terms("sliding_window(window_size=S//4)+alibi_causal")
    assert [t.name for t in terms] == ["sliding_window", "alibi_causal"]
    assert eval_param(terms[0].params[0][1], {"S": 4096}) == 1024
    with pytest.raises(VariantError, match="unbalanced"):
        split_terms("a(x=1")
    with pytest.raises(VariantError, match="unknown name"):
        eval_param("T//2", {"S": 8})


def test_registry_variant_and_mod_file_resolve(tmp_path):
    from tests.bench.helpers import ALIBI, CAUSAL

    mods = resolve(f"{ALIBI}+{CAUSAL}", B=1, H=4, KV_HEADS=4, Q_LEN=8, KV_LEN=8, D=4, device="cpu")
    assert mods.score_mod is not None and mods.mask_mod is not None
    assert [t.requires_grad for t in mods.captured.values()] == [True]
    reg = resolve("relative_bias(max_distance=4)", B=1, H=2, KV_HEADS=2, Q_LEN=8, KV_LEN=8, D=4,
                  device="cpu")
    assert reg.score_mod is not None and any(t.requires_grad for t in reg.captured.values())
    with pytest.raises(VariantError, match="unknown variant"):
        resolve("no_such_variant", B=1, H=1, KV_HEADS=1, Q_LEN=8, KV_LEN=8, D=4, device="cpu")


def test_grid_to_dict_is_json():
    grid = build_grid(load_config("tiny"), "tiny")
    assert json.loads(json.dumps(grid.to_dict()))["cases"][0]["variant"] == grid.cases[0].variant


def test_cuda_graph_passes():
    base = {"groups": [{"variants": ["causal"], "shapes": [[1, 8]], "heads": [2], "head_dim": [8]}],
            "providers": ["sdpa_math"]}
    assert build_grid(base).settings.graph_passes() == {"decode"}  # the default
    for value, passes in (("all", {"fwd", "fwd_bwd", "decode"}), ("none", set()), ("", set()),
                          ("fwd, decode", {"fwd", "decode"})):
        grid = build_grid({**base, "settings": {"cuda_graphs": value}})
        assert grid.settings.graph_passes() == passes, value


def test_small_preset_is_training_shapes_unpinned():
    grid = build_grid(load_config("small"), "small")
    assert {c.q_len for c in grid.cases} == {512, 1024, 2048}
    assert {c.head_dim for c in grid.cases} == {64, 128}
    assert {c.batch * c.q_heads for c in grid.cases} == {8, 16, 32, 64}
    assert {c.variant.split("(")[0] for c in grid.cases} == {"causal", "alibi_causal", "document"}
    assert {c.pass_ for c in grid.cases} == {"fwd", "fwd_bwd"}
    assert grid.settings.pin_host is False and grid.settings.rounds > 1  # interleaved providers
    assert {"flexlab", "flexlab_compiled", "torch_flex"} == set(grid.providers)


def test_fingerprint_ignores_order_and_max_minutes_but_not_what_is_measured():
    from bench.grid import config_differences, fingerprint

    grid = build_grid(load_config("tiny"), "tiny")
    data = grid.to_dict()
    reordered = {**data, "cases": data["cases"][::-1], "providers": data["providers"][::-1],
                 "settings": {**data["settings"], "max_minutes": 7}}
    assert fingerprint(reordered) == data["fingerprint"] and not config_differences(data, reordered)
    slower = {**data, "settings": {**data["settings"], "rep_ms": 50}}
    assert config_differences(data, slower) == ["settings.rep_ms: 100.0 -> 50.0"]
    assert fingerprint(slower) != data["fingerprint"]
    # A config.json written before settings gained a field compares equal to today's defaults.
    old = {**data, "settings": {k: v for k, v in data["settings"].items() if k != "compile_backend"}}
    assert not config_differences(old, data)


def test_fingerprint_and_differences_count_the_processes():
    from bench.grid import config_differences, fingerprint

    data = build_grid(load_config("tiny"), "tiny").to_dict()
    spread = {**data, "processes": 2}
    assert config_differences(spread, data) == ["processes: 2 -> 1 (--processes N)"]
    assert fingerprint(spread) != data["fingerprint"] == fingerprint({**data, "processes": 1})


def _shapes_of(**overrides):
    """(B, Hq, Hkv, Q, KV) of the tiny preset's float32 forward and decode cases (one variant)."""
    grid = build_grid(load_config("tiny"), "tiny", variants=["noop"], passes=["fwd", "decode"],
                      dtypes=["float32"], overrides=overrides)
    return [(c.batch, c.q_heads, c.kv_heads, c.q_len, c.kv_len) for c in grid.cases]


def test_each_shape_flag_changes_only_what_it_names():
    assert _shapes_of() == [(1, 4, 2, 128, 128), (2, 2, 2, 48, 80), (2, 4, 2, 1, 256)]
    # --kv-len: the KV lengths, every query length kept (it was ignored).
    assert _shapes_of(kv_len=[64]) == [(1, 4, 2, 128, 64), (2, 2, 2, 48, 64), (2, 4, 2, 1, 64)]
    # --q-len: the query lengths, every KV length kept (decode's KV 256 was turned into 16).
    assert _shapes_of(q_len=[16]) == [(1, 4, 2, 16, 128), (2, 2, 2, 16, 80), (2, 4, 2, 16, 256)]
    assert _shapes_of(q_len=[16], kv_len=[32, 64]) == [(b, hq, hkv, 16, kv) for b, hq, hkv in
                                                      ((1, 4, 2), (2, 2, 2), (2, 4, 2)) for kv in (32, 64)]
    # --batch: the batch alone; no shape pairs another shape's query and KV lengths.
    assert _shapes_of(batch=[3]) == [(3, 4, 2, 128, 128), (3, 2, 2, 48, 80), (3, 4, 2, 1, 256)]
    assert _shapes_of(seq=[32]) == [(1, 4, 2, 32, 32), (2, 2, 2, 32, 32), (2, 4, 2, 32, 32)]
    # --kv-heads: the KV heads, the query heads kept (it was "heads: [4, 2] is not an integer").
    assert _shapes_of(kv_heads=[1]) == [(1, 4, 1, 128, 128), (2, 2, 1, 48, 80), (2, 4, 1, 1, 256)]
    # --heads: the query heads; a group without GQA stays without it.
    assert _shapes_of(heads=[8]) == [(1, 8, 2, 128, 128), (2, 8, 8, 48, 80), (2, 8, 2, 1, 256)]
    assert _shapes_of(heads=[8], kv_heads=[4]) == [(1, 8, 4, 128, 128), (2, 8, 4, 48, 80), (2, 8, 4, 1, 256)]
    # The flags also change the keys of a group without shapes (the grid of flags alone).
    grid = build_grid({"variants": ["noop"], "batch": [1], "seq": [1024], "heads": [8], "head_dim": [64],
                       "providers": ["sdpa_math"]}, overrides={"q_len": [16], "kv_heads": [2]})
    assert [(c.q_len, c.kv_len, c.q_heads, c.kv_heads) for c in grid.cases] == [(16, 1024, 8, 2)]


@pytest.mark.parametrize("overrides, words", [
    ({"kv_heads": [3]}, ["--kv-heads: 4 query heads are not a multiple of 3 KV heads", "groups[0].heads"]),
    ({"heads": [3]}, ["--heads: 3 query heads are not a multiple of 2 KV heads"]),
    ({"kv_len": [0]}, ["--kv-len: 0 must be a positive integer"]),
    ({"seq": [32], "q_len": [16]}, ["--seq sets both lengths", "--q-len"]),
])
def test_shape_flag_errors_name_the_flag(overrides, words):
    with pytest.raises(ConfigError) as err:
        build_grid(load_config("tiny"), "tiny", overrides=overrides)
    for word in words:
        assert word in str(err.value)
