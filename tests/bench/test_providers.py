"""Provider availability on the CPU, skip reasons, and what SDPA can express."""
from __future__ import annotations

import pytest
import torch

from bench import providers as prov
from bench.context import make_context
from bench.grid import Case, Settings
from tests.bench.helpers import ALIBI, CAUSAL, SOFTCAP

CPU = torch.device("cpu")


def test_cpu_availability_and_reasons():
    avail = prov.availability(CPU)
    assert set(avail) == set(prov.PROVIDERS)
    assert avail["sdpa_math"][0] and avail["flexlab"][0]
    for name in ("torch_flex", "torch_flex_flash", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
                 "flash_attn", "flash4"):
        ok, why = avail[name]
        assert not ok and why, name
    assert "GPU" in avail["torch_flex"][1] and "CUDA" in avail["sdpa_flash"][1]


def test_unknown_provider_is_named():
    with pytest.raises(KeyError, match="no_such"):
        prov.get("no_such")


def _ctx(variant, q_len=24, kv_len=24, pass_="fwd"):
    case = Case(variant, 1, 2, 2, q_len, kv_len, 8, 8, "float32", pass_)
    return make_context(case, Settings(), CPU, n_sets=1)


def test_sdpa_expresses_causal_as_is_causal_and_bias_densely():
    p = prov.get("sdpa_math").prepare(_ctx(CAUSAL))
    assert p.note == "is_causal=True" and p.held_bytes == 0
    p = prov.get("sdpa_math").prepare(_ctx(f"{ALIBI}+{CAUSAL}"))
    assert "bias (1, 2, 24, 24)" in p.note and p.held_bytes == 2 * 24 * 24 * 4


def test_sdpa_refuses_what_it_cannot_express():
    with pytest.raises(prov.Unsupported, match="additive"):
        prov.get("sdpa_math").prepare(_ctx(SOFTCAP))
    # Flash takes no mask at all: fine for causal, refused for a bias.
    flash = prov.SDPAFlash()
    with pytest.raises(prov.Unsupported, match="attn_mask"):
        flash._express(_ctx(f"{ALIBI}+{CAUSAL}"))
    assert flash._express(_ctx(CAUSAL))[1] is True


def test_sdpa_math_matches_the_float64_reference():
    from flexcore.reference import flex_attention_reference

    ctx = _ctx(f"{ALIBI}+{CAUSAL}", 24, 40)
    x = ctx.inputs[0]
    out = prov.get("sdpa_math").prepare(ctx).call(x.q, x.k, x.v)
    ref = flex_attention_reference(x.q.double(), x.k.double(), x.v.double(), score_mod=ctx.mods.score_mod,
                                   block_mask=ctx.flex_block_mask())
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_flash_attn_provider_is_skipped_with_its_reason_on_cpu():
    ok, why = prov.get("flash_attn").available(CPU)
    assert not ok and "CUDA" in why


def test_flexlab_compiled_runs_or_says_why_it_does_not_compile(tmp_path):
    """flexcore inside torch.compile(fullgraph=True): a correct result, or an error row whose note
    gives torch.compile's reason (never a silent eager fallback: fullgraph refuses graph breaks)."""
    import json

    from bench import runner
    from bench.grid import build_grid

    grid = build_grid({"providers": ["flexlab_compiled"],
                       "settings": {"compile_backend": "aot_eager", "cpu_reps": 1, "block_size": 32},
                       "groups": [{"variants": [CAUSAL], "shapes": [[1, 32]], "heads": [2],
                                   "head_dim": [16], "dtype": ["float32"], "passes": ["fwd"]}]})
    rows = json.loads(runner.run(grid, tmp_path / "r", device=CPU, progress=False,
                                 log=lambda m: None).read_text())["rows"]
    mine = {r["metric"]: r for r in rows if r["provider"] == "flexlab_compiled"}
    if "status" in mine:
        note = mine["status"]["note"]
        assert mine["status"]["status"] == "error"
        assert "torch.compile(fullgraph=True, backend=aot_eager) of flexcore.flex_attention failed: " in note
        assert len(note.split("failed: ", 1)[1]) > 20  # the reason itself, not only a header
    else:
        assert mine["out_correct"]["value"] == 1 and mine["time_ms"]["value"] > 0
        assert mine["compile_s"]["note"].startswith("torch.compile(fullgraph=True, backend=aot_eager)")


def test_compile_failure_text_keeps_dynamos_explanation():
    class Unsupported(Exception):
        pass

    Unsupported.__module__ = "torch._dynamo.exc"
    exc = Unsupported("Attempted to call function marked as skipped\n  Explanation: Dynamo does not "
                      "know how to trace the builtin `posix.putenv.`\n  Hint: wrap it")
    assert prov.is_compile_error(exc) and not prov.is_compile_error(RuntimeError("CUDA error"))
    assert prov.compile_failure_text(exc) == ("Unsupported: Attempted to call function marked as "
                                              "skipped (Dynamo does not know how to trace the "
                                              "builtin `posix.putenv.`)")
