"""Errors raised by the testbed."""

from __future__ import annotations

__all__ = ["TestbedError", "TestbedUnavailable"]


class TestbedError(RuntimeError):
    """A testbed command failed, or a testbed is not in the state asked for.

    The message names the command (or testbed) and what went wrong.
    """

    # Not a test class, whatever pytest's name-based collection thinks.
    __test__ = False


class TestbedUnavailable(TestbedError):
    """This machine cannot host a testbed: not root, ``ip``/``tc`` missing, or a
    kernel feature (e.g. the ``netem`` qdisc) is absent.

    The message says what is missing and how to get it. Tests skip on it, except
    under ``CI=true`` where a missing capability is a failure.
    """

    # Not a test class, whatever pytest's name-based collection thinks.
    __test__ = False
