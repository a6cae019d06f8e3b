"""Vision patterns: 2-D neighborhood attention on an H x W image (NAT / NATTEN) and Flamingo's
text-to-image cross-attention."""
from __future__ import annotations

import torch

from variants.core import Mods, Param, Reference, Variant, VariantError


def generate_natten_mask(image_height: int, image_width: int, kernel_size: int):
    """2-D neighborhood attention: each pixel (raster order, row-major) sees the
    ``kernel_size x kernel_size`` neighbourhood centred on it, shifted inwards at the borders so
    that every pixel sees the same number of keys."""
    radius = kernel_size // 2

    def clamp_centre(coordinate, size):
        low, high = radius, size - 1 - radius
        return torch.where(coordinate < low, low, torch.where(coordinate > high, high, coordinate))

    def natten(b, h, q_idx, kv_idx):
        q_row, q_col = q_idx // image_width, q_idx % image_width
        kv_row, kv_col = kv_idx // image_width, kv_idx % image_width
        centre_row = clamp_centre(q_row, image_height)
        centre_col = clamp_centre(q_col, image_width)
        row_ok = (kv_row >= centre_row - radius) & (kv_row <= centre_row + radius)
        col_ok = (kv_col >= centre_col - radius) & (kv_col <= centre_col + radius)
        return row_ok & col_ok

    natten.__name__ = f"natten_{image_height}x{image_width}_k{kernel_size}"
    return natten


def text_image_index(num_text: int, num_images: int, device) -> torch.Tensor:
    """Index of the image most recently preceding each text token, shape ``(num_text,)``:
    image j is interleaved just before text position ``j * num_text // num_images``."""
    starts = torch.arange(num_images, dtype=torch.int64) * num_text // num_images
    position = torch.arange(num_text, dtype=torch.int64)
    return (torch.searchsorted(starts, position, right=True) - 1).to(device)


def generate_flamingo_mask(image_of_text: torch.Tensor, tokens_per_image: int,
                           only_last_image: bool):
    """Text queries attend to the visual tokens of the image just before them (or, if not
    ``only_last_image``, of every earlier image). Keys are ``tokens_per_image`` tokens per image.

    Args:
        image_of_text: ``(Q_LEN,)`` int tensor from ``text_image_index``.
    """
    def flamingo(b, h, q_idx, kv_idx):
        image = kv_idx // tokens_per_image
        latest = image_of_text[q_idx]
        return image == latest if only_last_image else image <= latest

    flamingo.__name__ = (f"flamingo_{tokens_per_image}tok"
                         + ("_last_image" if only_last_image else "_all_previous"))
    return flamingo


def _natten(shape, image_height, image_width, kernel_size):
    if kernel_size % 2 == 0 or kernel_size > min(image_height, image_width):
        raise VariantError(f"natten: kernel_size = {kernel_size} must be odd and at most "
                           f"min(image_height, image_width) = {min(image_height, image_width)}")
    pixels = image_height * image_width
    if max(shape.Q_LEN, shape.KV_LEN) > pixels:
        raise VariantError(f"natten: sequence length {max(shape.Q_LEN, shape.KV_LEN)} exceeds "
                           f"image_height * image_width = {pixels}; use a sequence of at most "
                           f"{pixels} tokens or a larger image")
    return Mods(mask_mod=generate_natten_mask(image_height, image_width, kernel_size))


def _flamingo(shape, tokens_per_image, num_images, only_last_image):
    if shape.KV_LEN != tokens_per_image * num_images:
        raise VariantError(f"flamingo: KV_LEN = {shape.KV_LEN} must equal tokens_per_image * "
                           f"num_images = {tokens_per_image * num_images} (leave KV_LEN unset "
                           f"to get it)")
    image_of_text = text_image_index(shape.Q_LEN, num_images, shape.device)
    return Mods(mask_mod=generate_flamingo_mask(image_of_text, tokens_per_image, only_last_image),
                captured={"image_of_text": image_of_text})


VARIANTS = (
    Variant(
        name="natten",
        title="2-D neighborhood attention (NATTEN)",
        description=("Tokens are the pixels (patches) of an image_height x image_width image in "
                     "raster order; each attends to the kernel_size x kernel_size neighbourhood "
                     "around it, shifted inwards at the borders. A sliding-window attention "
                     "for vision backbones with a convolution-like inductive bias."),
        reference=Reference("Neighborhood Attention Transformer", arxiv="2204.07143"),
        kind="mask",
        params=(Param("image_height", "int", 64, "image height in tokens", low=1, high=4096),
                Param("image_width", "int", 64, "image width in tokens", low=1, high=4096),
                Param("kernel_size", "int", 7, "odd neighbourhood size", low=1, high=4095)),
        build=_natten,
        recipe="mask_mod = generate_natten_mask({image_height}, {image_width}, {kernel_size})",
        helpers=(generate_natten_mask,),
        example={"image_height": 11, "image_width": 12, "kernel_size": 5},
    ),
    Variant(
        name="flamingo",
        title="Vision cross-attention (Flamingo)",
        description=("Cross-attention from text to visual tokens in interleaved image-text "
                     "sequences: each text token attends only to the tokens of the image that "
                     "most recently precedes it. Keys are num_images images of tokens_per_image "
                     "tokens (Perceiver-resampler latents)."),
        reference=Reference("Flamingo: a Visual Language Model for Few-Shot Learning",
                            arxiv="2204.14198"),
        kind="mask",
        params=(Param("tokens_per_image", "int", 64, "visual tokens per image", low=1,
                      high=1 << 16),
                Param("num_images", "int", 5, "images interleaved in the text", low=1,
                      high=1 << 16),
                Param("only_last_image", "bool", True,
                      "attend to the latest image only (else to all earlier images)")),
        build=_flamingo,
        recipe="""
            image_of_text = text_image_index(Q_LEN, {num_images}, device)
            mask_mod = generate_flamingo_mask(image_of_text, {tokens_per_image}, {only_last_image})
        """,
        helpers=(text_image_index, generate_flamingo_mask),
        example={"tokens_per_image": 9, "num_images": 7, "only_last_image": False},
        kv_len=lambda q_len, tokens_per_image, num_images, **_: tokens_per_image * num_images,
    ),
)
