"""`python -m mla_tune` runs the CLI."""

from mla_tune.cli.main import main

main()
