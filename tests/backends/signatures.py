"""Vendor function signatures recorded as data, so CPU tests can check that our calls bind.

A recorded parameter is `(name, default)`, with `REQUIRED` for no default; names after
`KEYWORD_ONLY` in a list are keyword-only. Each test file states the library version or
commit it read them from.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

REQUIRED = inspect.Parameter.empty
KEYWORD_ONLY = ("*", None)


def signature(params: Sequence[tuple[str, Any]]) -> inspect.Signature:
    """An `inspect.Signature` from recorded `(name, default)` pairs."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    out = []
    for name, default in params:
        if (name, default) == KEYWORD_ONLY:
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        out.append(inspect.Parameter(name, kind, default=default))
    return inspect.Signature(out)


def bind(params: Sequence[tuple[str, Any]], *args: Any, **kwargs: Any) -> inspect.BoundArguments:
    """Bind a call to a recorded signature; raises TypeError as the real call would."""
    return signature(params).bind(*args, **kwargs)
