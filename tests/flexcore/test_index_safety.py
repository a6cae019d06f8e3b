"""Index safety of mods (flexcore.lowering.check_indices): an index into a captured tensor that
leaves its range raises ModIndexError naming the tensor, its size, the index and the user's line,
wherever torch's eager evaluation raises IndexError; indices proven in range cost nothing after
the first call."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

from flexcore.errors import ModError, ModIndexError
from flexcore.lowering import check_indices, indexcheck, lower_mask_mod, lower_score_mod
from flexcore.reference import flex_attention_reference
from tests.flexcore.helpers import line_of

pytestmark = [pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


@pytest.fixture
def evaluations(monkeypatch):
    """Counts the grid evaluations the check runs."""
    calls = []
    real = indexcheck._evaluate

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(indexcheck, "_evaluate", counting)
    return calls


def test_issue_probe_bias_shorter_than_the_keys_is_caught():
    # issue 33's probe: bias of 40 entries, S = 80: torch's eager path raises IndexError.
    bias = torch.randn(40)

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]  # MARK-probe

    with pytest.raises(ModIndexError) as info:
        check_indices(add_bias, "score", 1, 2, 80, 80, runtime=False)
    err = info.value
    assert isinstance(err, IndexError) and isinstance(err, ModError)
    assert err.lineno == line_of(__file__, "MARK-probe") and err.filename == __file__
    assert err.size == 40 and err.expression == "kv_idx" and err.value == 40
    assert err.position == {"kv_idx": 40}
    text = str(err)
    for word in ("`bias`", "size 40", "`kv_idx` is 40", "kv_idx=40", "add_bias",
                 "return score + bias[kv_idx]", "KV_LEN=80"):
        assert word in text, (word, text)
    # The same shape with S = 40 is proven in range.
    verdict = check_indices(add_bias, "score", 1, 2, 40, 40, runtime=False)
    assert verdict.complete and len(verdict.proven) == 1


def test_reference_and_torch_both_raise_index_errors():
    bias = torch.randn(40)

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    q, k, v = (torch.randn(1, 1, 80, 8) for _ in range(3))
    with pytest.raises(IndexError):
        torch_flex.flex_attention(q, k, v, score_mod=add_bias)
    with pytest.raises(ModIndexError, match="`bias`"):
        flex_attention_reference(q, k, v, score_mod=add_bias)


def test_proven_indices_are_not_evaluated_and_the_verdict_is_kept(evaluations):
    table = torch.randn(2 * 64)
    slopes = torch.randn(4)

    def mod(score, b, h, q_idx, kv_idx):
        # affine, clamped, remaindered, negative (wrapping) indices: all provable
        return (score + table[q_idx - kv_idx] + table[torch.clamp(q_idx + kv_idx, 0, 127)]
                + slopes[h] + slopes[(q_idx * 7 + kv_idx) % 4] + table[(q_idx - kv_idx).abs()])

    verdict = check_indices(mod, "score", 2, 4, 64, 64, runtime=False)
    assert verdict.complete and len(verdict.proven) == 5 and not verdict.checked
    assert evaluations == []
    lowered = lower_score_mod(mod)
    assert check_indices(lowered, "score", 2, 4, 64, 64, runtime=False) == verdict


def test_value_independent_checks_run_once_per_shape(evaluations):
    table = torch.randn(16)

    def mod(b, h, q_idx, kv_idx):
        # q_idx in a roundabout way: intervals cannot prove it (kv_idx cancels), evaluation can.
        return table[q_idx - kv_idx + kv_idx] > 0

    for _ in range(3):
        verdict = check_indices(mod, "mask", 1, 1, 16, 9, runtime=False)
    assert verdict.complete and len(verdict.checked) == 1 and len(evaluations) == 1
    with pytest.raises(ModIndexError) as info:
        check_indices(mod, "mask", 1, 1, 20, 9, runtime=False)
    assert info.value.value == 16 and info.value.position["q_idx"] == 16
    assert info.value.expression == "(q_idx - kv_idx) + kv_idx"
    assert len(evaluations) == 2


def test_indices_read_from_captured_tensors_are_checked_at_run_time(evaluations):
    doc_ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    lengths = torch.tensor([2, 3, 2, 1])

    def in_doc(b, h, q_idx, kv_idx):
        return kv_idx < lengths[doc_ids[q_idx]]  # MARK-doc

    off = check_indices(in_doc, "mask", 1, 1, 8, 8, runtime=False)
    assert not off.complete and any("lengths" in u for u in off.unchecked)
    on = check_indices(in_doc, "mask", 1, 1, 8, 8, runtime=True)
    assert on.complete and evaluations == []  # proven from doc_ids' min and max
    doc_ids[5] = 4  # in place: the next run-time check sees it
    with pytest.raises(ModIndexError) as info:
        check_indices(in_doc, "mask", 1, 1, 8, 8, runtime=True)
    err = info.value
    assert err.position == {"q_idx": 5} and err.value == 4 and err.size == 4
    assert err.expression == "doc_ids[q_idx]" and "`lengths`" in str(err)
    assert err.lineno == line_of(__file__, "MARK-doc")
    doc_ids[5] = 2
    assert check_indices(in_doc, "mask", 1, 1, 8, 8, runtime=True).complete


def test_run_time_checks_are_skipped_while_captures_are_unchanged(evaluations, monkeypatch):
    doc_ids = torch.tensor([0, 3, 1, 2])
    lengths = torch.tensor([5, 9, 1, 2, 7, 7])

    def in_doc(b, h, q_idx, kv_idx):
        return kv_idx < lengths[doc_ids[q_idx] + 2]

    ranges = []
    real = indexcheck._value_range
    monkeypatch.setattr(indexcheck, "_value_range", lambda t: ranges.append(t) or real(t))
    for _ in range(3):
        assert check_indices(in_doc, "mask", 1, 1, 4, 4, runtime=True).complete
    first = len(ranges)
    assert evaluations == [] and first == 2  # doc_ids and lengths, at the first call only
    doc_ids.add_(0)  # a new version: checked again
    assert check_indices(in_doc, "mask", 1, 1, 4, 4, runtime=True).complete
    assert len(ranges) == first + 2


def test_batch_and_head_ranges_come_from_the_call():
    prefix = torch.tensor([5])  # one entry, for one batch

    def prefix_lm(b, h, q_idx, kv_idx):
        return kv_idx < prefix[b]

    assert check_indices(prefix_lm, "mask", 1, 8, 16, 16, runtime=False).complete
    with pytest.raises(ModIndexError) as info:
        check_indices(prefix_lm, "mask", 3, 8, 16, 16, runtime=False)
    assert info.value.position == {"b": 1} and "for any h, q_idx, kv_idx" in str(info.value)


def test_nested_out_of_range_never_reads_out_of_bounds():
    # The first index is out of range; the second reads with its result. The check clamps the
    # first while it records it, so it reports the first without an IndexError of its own.
    doc = torch.tensor([0, 1, 9])
    table = torch.randn(3, 3)

    def mod(b, h, q_idx, kv_idx):
        return table[doc[kv_idx], doc[q_idx]] > 0

    with pytest.raises(ModIndexError) as info:
        check_indices(mod, "mask", 1, 1, 3, 3, runtime=True)
    assert info.value.expression in ("doc[kv_idx]", "doc[q_idx]") and info.value.value == 9


def test_checks_go_through_the_grid_in_chunks(monkeypatch):
    monkeypatch.setattr(indexcheck, "CHUNK", 64)
    table = torch.randn(30, 40)

    def mod(b, h, q_idx, kv_idx):
        return table[q_idx * kv_idx // 50, kv_idx] > 0

    with pytest.raises(ModIndexError) as info:
        check_indices(mod, "mask", 1, 1, 40, 40, runtime=False)
    q, kv = info.value.position["q_idx"], info.value.position["kv_idx"]
    assert q * kv // 50 == info.value.value >= 30 and q * 40 + kv > 64  # found past the first chunk


def test_score_dependent_indices_are_reported_unchecked():
    table = torch.randn(8)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[(score.abs() * 4).long()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        verdict = check_indices(mod, "score", 1, 1, 8, 8, runtime=True)
    assert not verdict.complete and "depends on the score" in verdict.unchecked[0]
    assert any("could not be checked" in str(w.message) for w in caught)


def test_entry_point_accepts_lowered_mods_functions_and_none():
    table = torch.randn(16)

    def mask(b, h, q_idx, kv_idx):
        return table[kv_idx] > 0

    assert check_indices(None, "mask", 1, 1, 4, 4, runtime=True) == indexcheck.IndexVerdict()
    assert check_indices(lower_mask_mod(mask), "mask", 1, 1, 16, 16, runtime=False).complete
    with pytest.raises(ModIndexError):
        check_indices(lower_mask_mod(mask), "mask", 1, 1, 16, 17, runtime=False)
    no_lowering = check_indices(lambda b, h, q, kv: torch.special.zeta(q.float(), 2.0) > 0,
                                "mask", 1, 1, 4, 4, runtime=True)
    assert not no_lowering.lowered and not no_lowering.complete


def _torch_raises(mask_mod, shape) -> bool:
    try:
        torch_flex.create_mask(mask_mod, *shape, device="cpu")
    except (IndexError, RuntimeError) as e:
        assert "index" in str(e).lower(), e
        return True
    return False


def _cases():
    doc = torch.tensor([0, 0, 1, 2, 2, 3])
    lengths = torch.tensor([3, 1, 4, 2])
    window = torch.tensor([1, 2, 3])
    grid = torch.randint(0, 2, (6, 7)).bool()
    return {
        "in_range": lambda b, h, q, kv: lengths[doc[q]] > kv,
        "doc_past_lengths": lambda b, h, q, kv: lengths[doc[q] + 1] > kv,
        "per_head_window_ok": lambda b, h, q, kv: (q - kv).abs() <= window[h],
        "per_head_window_short": lambda b, h, q, kv: (q - kv).abs() <= window[h + 1],
        "table_2d_ok": lambda b, h, q, kv: grid[q][kv],
        "table_2d_transposed": lambda b, h, q, kv: grid[kv][q],
        "negative_wraps": lambda b, h, q, kv: grid[q - 6, kv - 7],
        "negative_too_far": lambda b, h, q, kv: grid[q - 7, kv],
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_raises_exactly_where_torch_raises(name):
    mod = _cases()[name]
    shape = (1, 3, 6, 7)
    torch_raised = _torch_raises(mod, shape)
    try:
        check_indices(mod, "mask", *shape, runtime=True)
        ours = False
    except ModIndexError:
        ours = True
    assert ours == torch_raised, (name, ours, torch_raised)
    assert torch_raised == (name in ("doc_past_lengths", "per_head_window_short",
                                     "table_2d_transposed", "negative_too_far"))


def test_constant_index_out_of_range_is_an_index_error_at_lowering():
    table = torch.randn(3, 5)
    with pytest.raises(ModIndexError):
        lower_mask_mod(lambda b, h, q, kv: table[3, kv] > 0)
    vec = torch.randn(4)
    with pytest.raises(ModIndexError):
        lower_mask_mod(lambda b, h, q, kv: vec[kv][None][1] > 0)  # a size-1 view, index 1


@pytest.mark.gpu
def test_checks_run_where_the_captured_tensors_live():
    # On the GPU the evaluation runs on the captured tensors' device; the reference raises the
    # same error before torch's indexing could trip a device-side assert.
    bias = torch.randn(40, device="cuda")
    doc_ids = torch.tensor([0, 1, 1, 2, 5, 0, 0, 1], device="cuda")
    lengths = torch.tensor([3, 2, 4], device="cuda")

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    def in_doc(b, h, q_idx, kv_idx):
        return kv_idx < lengths[doc_ids[q_idx]]

    with pytest.raises(ModIndexError) as info:
        check_indices(add_bias, "score", 1, 2, 80, 80, runtime=False)
    assert info.value.position == {"kv_idx": 40}
    assert not check_indices(in_doc, "mask", 1, 1, 8, 8, runtime=False).complete
    with pytest.raises(ModIndexError) as info:
        check_indices(in_doc, "mask", 1, 1, 8, 8, runtime=True)
    assert info.value.position == {"q_idx": 4} and info.value.value == 5
    q, k, v = (torch.randn(1, 1, 80, 16, device="cuda") for _ in range(3))
    with pytest.raises(ModIndexError, match="`bias`"):
        flex_attention_reference(q, k, v, score_mod=add_bias)


@pytest.mark.gpu
def test_repeated_calls_check_each_new_mod():
    # A repeated eager call keeps the verdict of the mods it checked (flexcore.attention._Call):
    # another mod, or the same one reading a shorter tensor, is checked again at the same shapes.
    from flexcore import flex_attention

    q, k, v = (torch.randn(1, 2, 96, 16, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(96, device="cuda")

    def in_range(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    def past_the_end(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx + 1]

    for _ in range(2):
        flex_attention(q, k, v, score_mod=in_range)
    with pytest.raises(ModIndexError, match="`bias`"):
        flex_attention(q, k, v, score_mod=past_the_end)
    bias = torch.randn(95, device="cuda")  # the closure's tensor rebound: a new lowering
    with pytest.raises(ModIndexError, match="`bias`"):
        flex_attention(q, k, v, score_mod=in_range)


def test_costly_checks_wait_for_run_time_checks(monkeypatch, evaluations):
    monkeypatch.setattr(indexcheck, "STATIC_BUDGET", 50)
    table = torch.randn(9)

    def mod(b, h, q_idx, kv_idx):
        return table[q_idx - kv_idx + kv_idx] > 0  # not provable: evaluated over (q, kv)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        off = check_indices(mod, "mask", 1, 1, 9, 8, runtime=False)
    assert not off.complete and "waits for run-time checks" in off.unchecked[0]
    assert evaluations == [] and any("could not be checked" in str(w.message) for w in caught)
    assert check_indices(mod, "mask", 1, 1, 9, 8, runtime=True).complete
    assert len(evaluations) == 1
    assert check_indices(mod, "mask", 1, 1, 9, 8, runtime=False).complete  # kept
    with pytest.raises(ModIndexError):
        check_indices(mod, "mask", 1, 1, 10, 8, runtime=True)


def test_constant_index_out_of_range_raises_through_the_entry_point():
    table = torch.randn(3)
    with pytest.raises(ModIndexError):
        check_indices(lambda b, h, q, kv: table[5] > 0, "mask", 1, 1, 4, 4, runtime=False)
