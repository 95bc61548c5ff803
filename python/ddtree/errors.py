"""The package's exception base class.

Every exception ddtree's Python code defines derives from :class:`DDTreeError` and from the builtin class its
meaning matches (``ValueError`` for bad input, ``RuntimeError`` for a state ddtree cannot continue from), so
``except DDTreeError`` catches all of them and ``except ValueError`` keeps working. The Rust core raises the
builtin ``ValueError``, ``TypeError`` and ``RuntimeError`` (mapped in one place, ``rust/src/python/mod.rs``).
"""


class DDTreeError(Exception):
    """Base class of the exceptions ddtree defines."""
