"""The command line's subcommands (``python -m gpusolver <command>``), one module each.

``gpusolver.__main__`` builds the parser; each module here holds one command's
work: ``demo`` (the layer loop over dist_attn), ``quality`` (solver vs the
classic schemes on one mask), ``show`` (a plan's picture) and ``bench``
(the benchmark report). Argument types shared by the commands are in
``args``.
"""
