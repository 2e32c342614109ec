"""Thin KFP components, one per stage: each imports ``lmforge`` inside its body and calls one entry function."""
