"""One base for every error mxrefit raises, so a trainer can catch mxrefit's failures in one clause.

Each error also keeps the builtin it derives from (``ValueError`` for bad input, ``RuntimeError``
for a failed step, ``MemoryError`` for host memory), so code that caught those still does.
"""


class MxrefitError(Exception):
    """Base of every exception mxrefit raises on purpose."""
