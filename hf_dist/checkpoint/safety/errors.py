"""The loading gate's errors, and the base of the inert stand-ins it unpickles foreign classes into."""

from __future__ import annotations


class OpaqueObject:
    """Stand-in for a class we never need to behave: keeps the pickled attributes, runs no code."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"


class UnsafePickleError(RuntimeError):
    """A checkpoint file holds a type outside the allowlist."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file cannot be read (truncated, not a torch archive)."""
