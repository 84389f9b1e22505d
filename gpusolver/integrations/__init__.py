"""Integrations with model libraries (each imports its library only when imported itself).

- ``gpusolver.integrations.transformers``: ``register(attn)`` makes
  ``attn_implementation="gpusolver"`` run a ``DynamicCPAttention`` in Hugging Face
  Transformers models; ``cp_context``, ``cp_plans``.

Packed batches (labels, positions, masks, the loss) are ``gpusolver.packing``;
plain-torch models (torchtitan-style) and DP x CP meshes are in ``examples/``.
"""
