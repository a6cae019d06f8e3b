"""Triton kernels: templates filled with lowered mods (see flexcore/README.md)."""
