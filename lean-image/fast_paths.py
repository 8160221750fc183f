"""The fast acceptors of the read path, and the rules each one accepts.

A fast path stands in for an authoritative call (the one the spec's rules are written
against: each rule is checked by the one function rules.implements registered) when many links
of a chain are opened: it tests the plain case of the rules for all links at once, and a link
that fails a test, or is not of the plain shape, goes to the authoritative call, which raises
its finding. Each fast path declares here, with ``@fast_path``, how it covers every rule its
authoritative call enforces:

- ``tests``: rules whose plain case it tests itself (a link failing the test is declined);
- ``calls``: rules it leaves to their own implementation, which it calls;
- ``by_shape``: rules that cannot fail for the shape it accepts (e.g. the disk table's rules,
  for links that have no DISK record).

A rule may be both tested and called: tables_batch tests the record rules of each PAGE_MAP
itself and has ImageTables.record check its REGION record.

tests/test_fast_paths.py traces the registered implementations each authoritative call and
each fast path runs, and fails when the authoritative call enforces a rule a fast path neither
declares nor calls: adding a rule is not done until every fast path says how it covers it
(spec/guides/architecture.md, "Adding a rule: the checklist").

``LEANIMG_CROSS_CHECK=1`` (a debug switch; CI runs the chain tests once with it) makes every
fast path run its authoritative call beside itself for each link it accepts and compare: a
link the authoritative call refuses, or reads differently, raises ``Disagreement``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .rules import RULES

MODES = ("0", "1")


@dataclass(frozen=True)
class FastPath:
    name: str  # module.qualname of the fast acceptor
    instead_of: str  # the authoritative call whose result it stands in for
    tests: frozenset[str]
    calls: frozenset[str]
    by_shape: frozenset[str]

    @property
    def covers(self) -> frozenset[str]:
        return self.tests | self.calls | self.by_shape


FAST_PATHS: dict[str, FastPath] = {}


class Disagreement(AssertionError):
    """A fast path accepted a link its authoritative call refuses or reads differently
    (LEANIMG_CROSS_CHECK=1): a defect of leanimg, never of the image."""


def fast_path(instead_of: str, tests=(), calls=(), by_shape=()):
    """Register the decorated function as a fast path standing in for ``instead_of``."""

    def register(function):
        name = f"{function.__module__}.{function.__qualname__}"
        declared = [*tests, *calls, *by_shape]
        unknown = sorted(set(declared) - set(RULES))
        if unknown:
            raise ValueError(f"{name}: unknown rules {', '.join(unknown)}")
        if any(len(group) != len(set(group)) for group in (tests, calls, by_shape)):
            raise ValueError(f"{name}: a rule is listed twice in one group")
        FAST_PATHS[name] = FastPath(name, instead_of, frozenset(tests), frozenset(calls), frozenset(by_shape))
        return function

    return register


def _cross_check() -> bool:
    mode = os.environ.get("LEANIMG_CROSS_CHECK", "0")
    if mode not in MODES:
        raise ImportError(f"LEANIMG_CROSS_CHECK must be one of {', '.join(MODES)}, not {mode!r}")
    return mode == "1"


CROSS_CHECK = _cross_check()


def disagree(path: str, fast: str, what: str) -> Disagreement:
    return Disagreement(f"{path}: the fast path {fast} and its authoritative call disagree: {what}")
