"""The formats of the artifacts that pass between stages, each declared once with its readers and writers.

A stage reads another stage's output only through these modules (and :mod:`lmforge.contracts`,
:mod:`lmforge.artifacts`), never by importing the other stage's module:

- :mod:`lmforge.formats.cleaned`: the cleaned corpus and the cleaned shards of the cleaning fan-out;
- :mod:`lmforge.formats.dedup`: each cleaned shard's dedup signatures and the dedup plan;
- :mod:`lmforge.formats.token_shards`: the token shards ``tokenize`` writes and the training stages read.
"""
