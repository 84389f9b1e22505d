"""The track step of a round: ``ref.py`` (torch twin), ``kernel.py`` (Triton)."""
