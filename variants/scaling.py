"""Score scaling: tanh soft-capping (Gemma 2) and per-head learnable temperature (Swin V2)."""
from __future__ import annotations

import torch

from flexcore import and_masks
from variants.basic import generate_causal_mask
from variants.core import Mods, Param, Reference, Variant
from variants.windows import generate_sliding_window


def generate_tanh_softcap(softcap: torch.Tensor):
    """Soft-capping: ``softcap * tanh(score / softcap)`` bounds logits to (-softcap, softcap).

    Args:
        softcap: 0-d float tensor, captured so that changing it does not recompile.
    """
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    tanh_softcap.__name__ = f"tanh_softcap_{float(softcap):g}"
    return tanh_softcap


def head_temperatures(H: int, init_min: float, init_max: float,
                      device) -> torch.Tensor:
    """Learnable ``(H,)`` float32 temperatures, evenly spaced from min to max across heads."""
    return torch.linspace(init_min, init_max, H, dtype=torch.float32).to(
        device).requires_grad_()


def generate_head_temperature(temperature: torch.Tensor):
    """Per-head temperature: ``score / max(temperature[h], 0.01)``.

    Args:
        temperature: ``(H,)`` learnable float tensor.
    """
    def head_temperature(score, b, h, q_idx, kv_idx):
        tau = temperature[h]
        return score / torch.where(tau > 0.01, tau, 0.01)  # Swin V2 keeps tau above 0.01

    head_temperature.__name__ = f"head_temperature_{temperature.numel()}heads"
    return head_temperature


def _softcap_tensor(softcap: float, device) -> torch.Tensor:
    return torch.tensor(softcap, dtype=torch.float32, device=device)


def _softcap(shape, softcap):
    cap = _softcap_tensor(softcap, shape.device)
    return Mods(score_mod=generate_tanh_softcap(cap), captured={"softcap": cap})


def _softcap_causal(shape, softcap):
    cap = _softcap_tensor(softcap, shape.device)
    return Mods(score_mod=generate_tanh_softcap(cap), mask_mod=generate_causal_mask(),
                captured={"softcap": cap})


def _gemma2_local(shape, softcap, window_size):
    cap = _softcap_tensor(softcap, shape.device)
    return Mods(score_mod=generate_tanh_softcap(cap),
                mask_mod=and_masks(generate_causal_mask(), generate_sliding_window(window_size)),
                captured={"softcap": cap})


def _temperature(shape, init_min, init_max):
    temperature = head_temperatures(shape.H, init_min, init_max, shape.device)
    return Mods(score_mod=generate_head_temperature(temperature),
                captured={"temperature": temperature})


GEMMA2 = Reference("Gemma 2: Improving Open Language Models at a Practical Size",
                   arxiv="2408.00118")
_SOFTCAP = Param("softcap", "float", 50.0, "logit cap (Gemma 2 uses 50 in attention)",
                 low=0.1, high=1000.0)
_SOFTCAP_RECIPE = "softcap = torch.tensor({softcap}, dtype=torch.float32, device=device)\n"

VARIANTS = (
    Variant(
        name="softcap",
        title="Tanh soft-capping",
        description=("Logits pass through softcap * tanh(score / softcap), which bounds them "
                     "smoothly and stabilises training of large models; Gemma 2 caps attention "
                     "logits at 50. The cap is a captured tensor, so changing it does not "
                     "recompile."),
        reference=GEMMA2,
        kind="score",
        params=(_SOFTCAP,),
        build=_softcap,
        recipe=_SOFTCAP_RECIPE + "score_mod = generate_tanh_softcap(softcap)",
        helpers=(generate_tanh_softcap,),
        example={"softcap": 2.5},
    ),
    Variant(
        name="softcap_causal",
        title="Tanh soft-capping + causal",
        description=("Soft-capped logits on a causal decoder, as Gemma 2's global layers use "
                     "them. A benchmark anchor for a transcendental score_mod."),
        reference=GEMMA2,
        kind="both",
        params=(_SOFTCAP,),
        build=_softcap_causal,
        recipe=(_SOFTCAP_RECIPE + "score_mod = generate_tanh_softcap(softcap)\n"
                "mask_mod = generate_causal_mask()"),
        helpers=(generate_tanh_softcap, generate_causal_mask),
        example={"softcap": 1.5},
    ),
    Variant(
        name="gemma2_local",
        title="Soft-capping + sliding window (Gemma 2 local layers)",
        description=("Gemma 2 alternates global layers with local layers that attend to a "
                     "4096-token causal sliding window, both with attention logits soft-capped "
                     "at 50."),
        reference=GEMMA2,
        kind="both",
        params=(_SOFTCAP,
                Param("window_size", "int", 4096, "keys each query sees, itself included",
                      low=1, high=1 << 20)),
        build=_gemma2_local,
        recipe=(_SOFTCAP_RECIPE + "score_mod = generate_tanh_softcap(softcap)\n"
                "mask_mod = and_masks(generate_causal_mask(), "
                "generate_sliding_window({window_size}))"),
        helpers=(generate_tanh_softcap, generate_causal_mask, generate_sliding_window),
        example={"softcap": 3.0, "window_size": 33},
    ),
    Variant(
        name="head_temperature",
        title="Per-head temperature",
        description=("Each head divides its logits by its own learnable temperature (kept above "
                     "0.01), as in Swin Transformer V2's scaled cosine attention, where q and k "
                     "are L2-normalised first. Lets heads choose sharp or flat attention."),
        reference=Reference("Swin Transformer V2: Scaling Up Capacity and Resolution",
                            arxiv="2111.09883"),
        kind="score",
        params=(Param("init_min", "float", 0.5, "initial temperature of head 0", low=0.01,
                      high=100.0),
                Param("init_max", "float", 2.0, "initial temperature of the last head",
                      low=0.01, high=100.0)),
        build=_temperature,
        recipe="""
            temperature = head_temperatures(H, {init_min}, {init_max}, device)
            score_mod = generate_head_temperature(temperature)
        """,
        helpers=(head_temperatures, generate_head_temperature),
        example={"init_min": 0.05, "init_max": 0.3},
    ),
)
