"""Thin command-line entry points: parse, build a config, run, shut down cleanly."""
