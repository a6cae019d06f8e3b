"""The registry itself: metadata, parameter validation, mod names, purity, flags and the
Playground snippets, for every variant."""
from __future__ import annotations

import ast
import dataclasses

import pytest
import torch

import variants
from variants import Param, UnknownVariantError, VariantError
from tests.variants.helpers import (CASES, HEADS, case_params, case_q_len, dense_mask,
                                    dense_scores, make_case)

REQUIRED = {
    "noop", "causal", "sliding_window", "local_window", "dilated_window", "longformer",
    "streaming_llm", "prefix_lm", "document", "shared_prefix", "chunked", "block_causal",
    "natten", "bigbird", "flamingo", "speculative_tree", "key_padding", "duo_attention",
    "alibi", "relative_bias", "t5_bias", "softcap", "sandwich", "head_temperature", "kerple",
    "alibi_causal", "softcap_causal",
}
NAMES = variants.names()


def test_registry_holds_the_required_variants():
    assert len(NAMES) >= 25
    assert REQUIRED <= set(NAMES), f"missing: {sorted(REQUIRED - set(NAMES))}"
    assert sorted(NAMES) == sorted(variants.REGISTRY)
    kinds = {variants.get(n).kind for n in NAMES}
    assert kinds == {"mask", "score", "both"}


@pytest.mark.parametrize("name", NAMES)
def test_metadata_is_complete(name):
    variant = variants.get(name)
    assert variant.name == name
    assert variant.title and len(variant.description) > 60
    assert variant.reference.title and variant.reference.link.startswith("https://")
    assert variant.reference.arxiv is None or variant.reference.arxiv.count(".") == 1
    for param in variant.params:
        assert param.help, f"{name}.{param.name} has no help line"
        assert param.check(param.default, name) == param.default
    if variant.params:
        assert variant.example, f"{name} needs a non-default example setting"
        resolved = variant.resolve_params(**variant.example)
        assert resolved != variant.defaults(), f"{name}'s example equals its defaults"
    assert variant.summary().startswith(f"{name}: ")
    assert variant.family in {"basic", "windows", "documents", "blocks", "vision", "decoding",
                              "heads", "bias", "scaling"}


@pytest.mark.parametrize("name,setting", CASES)
def test_make_returns_the_declared_kind(name, setting):
    variant = variants.get(name)
    mods = make_case(name, setting)
    assert (mods.score_mod is not None) == (variant.kind in ("score", "both"))
    assert (mods.mask_mod is not None) == (variant.kind in ("mask", "both"))
    for tensor in mods.captured.values():
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
        if tensor.requires_grad:
            assert tensor.is_leaf and tensor.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_mod_names_encode_parameters(name):
    variant = variants.get(name)
    default = variant.make(H=HEADS, Q_LEN=case_q_len("example")).name
    assert default and "<lambda>" not in default
    # Seeds and initial values of learnable tensors are not part of a mod's identity.
    structural = {k for k, v in variant.example.items()
                  if k != "seed" and "init" not in k and v != variant.param(k).default}
    if structural:
        example = make_case(name, "example")
        assert example.name != default, f"{name}: {default!r} does not change with {structural}"


def test_mod_names_read_like_attention_gym():
    assert variants.get("sliding_window").make(window_size=256).name == "sliding_window_256"
    assert variants.get("chunked").make(chunk_size=512).name == "chunked_causal_512"
    assert variants.get("softcap").make(softcap=30.0).name == "tanh_softcap_30"
    assert variants.get("alibi_causal").make(H=16).name == "causal+alibi_16heads"


@pytest.mark.parametrize("name,setting", CASES)
def test_make_is_pure_and_deterministic(name, setting):
    rng_before = torch.random.get_rng_state()
    first, second = make_case(name, setting), make_case(name, setting)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "make used the global RNG"
    assert first.captured.keys() == second.captured.keys()
    for key in first.captured:
        assert first.captured[key] is not second.captured[key]
        assert torch.equal(first.captured[key].detach(), second.captured[key].detach())


@pytest.mark.parametrize("name,setting", CASES)
def test_source_snippet_makes_the_same_mods(name, setting):
    variant = variants.get(name)
    mods = make_case(name, setting)
    shape = mods.shape
    source = variant.source(B=shape.B, H=shape.H, Q_LEN=shape.Q_LEN,
                            **case_params(name, setting))
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.split(".")[0])
    assert imported <= {"torch", "flexcore", "math"}, f"snippet imports {imported}"
    namespace: dict = {}
    exec(compile(source, f"<{name} snippet>", "exec"), namespace)
    assert callable(namespace.get("mask_mod")) == (mods.mask_mod is not None)
    assert callable(namespace.get("score_mod")) == (mods.score_mod is not None)
    dims = (shape.B, shape.H, shape.Q_LEN, shape.KV_LEN)
    if mods.mask_mod is not None:
        assert namespace["mask_mod"].__name__ == mods.mask_mod.__name__
        assert torch.equal(dense_mask(namespace["mask_mod"], *dims),
                           dense_mask(mods.mask_mod, *dims))
    if mods.score_mod is not None:
        assert namespace["score_mod"].__name__ == mods.score_mod.__name__
        scores = torch.randn(*dims, generator=torch.Generator().manual_seed(0))
        assert torch.equal(dense_scores(namespace["score_mod"], scores),
                           dense_scores(mods.score_mod, scores))


def test_get_unknown_name_lists_valid_names_and_suggests():
    with pytest.raises(UnknownVariantError) as info:
        variants.get("sliding_windw")
    message = str(info.value)
    assert "'sliding_windw'" in message and "Did you mean 'sliding_window'" in message
    assert all(name in message for name in NAMES)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_unknown_parameter_lists_valid_parameters():
    with pytest.raises(VariantError) as info:
        variants.get("dilated_window").resolve_params(dilatation=3)
    message = str(info.value)
    assert "'dilatation'" in message and "Did you mean 'dilation'" in message
    for fragment in ("window_size (int in [1, 1048576], default 256)",
                     "dilation (int in [1, 1024], default 2)", "causal (bool"):
        assert fragment in message


@pytest.mark.parametrize("name,value", [("window_size", 0), ("window_size", 2.5),
                                        ("window_size", "8"), ("window_size", True)])
def test_out_of_range_or_mistyped_values_are_rejected(name, value):
    with pytest.raises(VariantError, match=r"window_size.*expected int in \[1, 1048576\]"):
        variants.get("sliding_window").make(**{name: value})


def test_choice_and_bool_validation():
    bigbird = variants.get("bigbird")
    with pytest.raises(VariantError, match=r"one of 1, 3, 5, 7, 9"):
        bigbird.resolve_params(window_blocks=4)
    with pytest.raises(VariantError, match=r"bool"):
        variants.get("document").resolve_params(causal=1)
    assert bigbird.param("window_blocks").parse("5", "bigbird") == 5
    assert variants.get("document").param("causal").parse("false", "document") is False


def test_parameter_checks_cover_cross_parameter_constraints():
    with pytest.raises(VariantError, match="kernel_size = 4 must be odd"):
        variants.get("natten").make(Q_LEN=64, kernel_size=4)
    with pytest.raises(VariantError, match="exceeds image_height"):
        variants.get("natten").make(Q_LEN=5000)
    with pytest.raises(VariantError, match="KV_LEN = 100 must equal"):
        variants.get("flamingo").make(Q_LEN=50, KV_LEN=100)
    with pytest.raises(VariantError, match="draft tokens"):
        variants.get("speculative_tree").make(Q_LEN=20, depth=5)
    with pytest.raises(VariantError, match="Q_LEN = 0"):
        variants.get("causal").make(Q_LEN=0)
    for buckets in (2, 3):  # half the buckets per direction, half of those exact: at least 4
        with pytest.raises(VariantError, match="'num_buckets' = .* bidirectional=True"):
            variants.get("t5_bias").make(H=2, Q_LEN=8, num_buckets=buckets)
    variants.get("t5_bias").make(H=2, Q_LEN=8, num_buckets=2, bidirectional=False)


def test_param_declarations_are_checked():
    with pytest.raises(ValueError):
        Param("B", "int", 1, "reserved name", low=0, high=2)
    with pytest.raises(ValueError):
        Param("x", "int", 1, "no range")
    with pytest.raises(VariantError):
        Param("x", "int", 5, "default out of range", low=0, high=2)


def test_block_mask_dims_follow_dependence_flags():
    mods = variants.get("prefix_lm").make(B=3, H=4, Q_LEN=64)
    assert mods.block_mask_dims() == (3, None)
    mods = variants.get("bigbird").make(B=3, H=4, Q_LEN=64)
    assert mods.block_mask_dims() == (None, 4)
    assert dataclasses.replace(mods, head_dependent=False).block_mask_dims() == (None, None)


def test_kv_len_defaults_to_the_variant_layout():
    flamingo = variants.get("flamingo")
    assert flamingo.default_kv_len(100, tokens_per_image=8, num_images=3) == 24
    assert flamingo.make(Q_LEN=100, tokens_per_image=8, num_images=3).shape.KV_LEN == 24
    assert variants.get("causal").make(Q_LEN=100).shape.KV_LEN == 100


@pytest.mark.parametrize("name,setting", CASES)
def test_learnable_is_the_captured_tensors_that_require_grad(name, setting):
    mods = make_case(name, setting)
    assert mods.learnable == {k: t for k, t in mods.captured.items() if t.requires_grad}
    for key, tensor in mods.learnable.items():
        assert mods.captured[key] is tensor


def test_bench_specs_resolve_to_the_gallery_mods_type():
    # One Mods type: a bench spec of a registry variant resolves to variants.Mods, with the
    # variant's learnable tensors under their own names and the case's shape.
    from bench import mods as bench_mods

    mods = bench_mods.resolve("kerple+causal", B=1, H=HEADS, KV_HEADS=HEADS, Q_LEN=48, KV_LEN=64,
                              D=16, device="cpu")
    assert type(mods) is variants.Mods
    assert set(mods.learnable) == {"r1", "r2"} and mods.mask_mod is not None
    assert (mods.shape.B, mods.shape.H, mods.shape.Q_LEN, mods.shape.KV_LEN) == (1, HEADS, 48, 64)
    assert bench_mods.VariantError is VariantError
    shifted = bench_mods.offset_indices(mods, q0=16)
    assert type(shifted) is variants.Mods and shifted.captured == mods.captured
    q = torch.arange(48).view(48, 1)
    kv = torch.arange(64).view(1, 64)
    assert torch.equal(shifted.mask_mod(0, 0, q, kv), mods.mask_mod(0, 0, q + 16, kv))
