"""The ``preflight`` stage (:mod:`lmforge.preflight.preflight`): the checks that fail a run before its first
GPU step."""
