"""Attention over slices: ``kernel.py`` (Triton), ``ref.py`` (torch twin), ``op.py`` (custom ops)."""
