"""`mla-tune` command line: thin wrappers over sweep, report, diff, export/import, doctor,
prune, rehash and route, one module each (parse, call, print).

Bad input exits with code 2 and a message saying what was wrong and what to do; nothing
stored is touched before the input has been validated.
"""

from __future__ import annotations

import inspect

from mla_tune.cli.common import app, console, out

# isort: off
# Each import registers its commands; `mla-tune --help` lists them in this order.
from mla_tune.cli import sweep, report, doctor, diff, exchange, maintenance  # noqa: F401
from mla_tune.cli.route import route
# isort: on

app.command("route")(route)

__all__ = ["app", "console", "diff", "doctor", "exchange", "main", "maintenance", "out",
           "report", "sweep"]


def main() -> None:
    app()


def _unwrapped(doc: str) -> str:
    """A docstring's paragraphs each on one line, so help text is wrapped by the terminal's
    width, not where the source happened to break its lines."""
    return "\n\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


for _command in app.registered_commands:
    if _command.help is None and _command.callback is not None and _command.callback.__doc__:
        _command.help = _unwrapped(inspect.getdoc(_command.callback) or "")
