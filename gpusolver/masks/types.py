"""The slice type codes: the one place they are defined.

A slice's ``attn_type`` entry is one of these int codes (see
``gpusolver.masks.slices`` for what each allows). Kernels below ``gpusolver``
(``attn_kernels``) take the same codes as plain ints, since they import
nothing of this package.
"""

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3
ATTN_TYPE_NAMES = {FULL: "FULL", CAUSAL: "CAUSAL", INV_CAUSAL: "INV_CAUSAL", BI_CAUSAL: "BI_CAUSAL"}
