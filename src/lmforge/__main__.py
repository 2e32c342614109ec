"""``python -m lmforge`` runs the CLI (with the installed plugins' commands)."""

from lmforge.cli import application

application()(prog_name="lmforge")
