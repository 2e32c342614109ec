"""Pipelines built from the lmforge components; compiled YAML lives in ``pipelines/compiled/``."""
