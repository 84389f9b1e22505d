"""Group collectives over a CP group: ``group_cast`` and ``group_reduce``.

Not implemented yet: this package is reserved for the collectives that
execute a Plan's CommMeta (all-to-all-v over torch.distributed, a sync-free
symmetric-memory backend on GPU, and a simulated single-process group).
It is named ``groupcomm`` rather than ``comm`` because a top-level ``comm``
package would overwrite the one every Jupyter install carries.
"""

__all__: list[str] = []
