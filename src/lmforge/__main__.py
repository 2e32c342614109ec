"""``python -m lmforge`` runs the CLI."""

from lmforge.cli import app

app(prog_name="lmforge")
