"""Exception groups of one. A nursery wraps even a single error in a group (nested, one
group a nursery); callers of an engine or a worker catch that error by its own type."""

from __future__ import annotations

from contextlib import contextmanager


def sole(group: BaseException) -> BaseException:
    """The one exception inside nested groups of one; the group itself when it holds
    more (or anything that is not a group)."""
    while isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 1:
        group = group.exceptions[0]
    return group


@contextmanager
def sole_error():
    """Raise a task group's one error as itself (a group of several stays a group)."""
    try:
        yield
    except BaseExceptionGroup as group:
        raise sole(group) from None
