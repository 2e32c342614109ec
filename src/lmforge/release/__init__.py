"""Releases under ``<release_root>/models/<model_name>/``: the registry's layout and its readers
(:mod:`~lmforge.release.catalog`), the ``promote`` stage that publishes a gated model and moves ``latest.json``
(:mod:`~lmforge.release.promote`), the model cards it writes and ``lmforge push`` uploads
(:mod:`~lmforge.release.model_card`), and ``lmforge registry gc`` (:mod:`~lmforge.release.gc`), which removes what
failed promotions and publishes left behind."""
