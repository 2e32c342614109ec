"""Releases: the ``promote`` stage (:mod:`lmforge.release.promote`) publishes a gated model under
``<release_root>/models/<model_name>/<version>/`` and moves ``latest.json``; ``lmforge gc`` collects what failed
publishes left behind."""
