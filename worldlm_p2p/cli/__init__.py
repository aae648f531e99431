"""Thin command-line entry points: parse, build a config, run, shut down cleanly.

- ``common``: one-line errors with exit code 2, signal handling, ``--config`` files, flags derived
  from config fields.
- ``peer``: ``worldlm-peer``; ``bootstrap``: ``worldlm-bootstrap``; ``swarm``: ``worldlm-swarm``;
  ``monitor``: ``worldlm-monitor``; ``simulate``: ``worldlm-simulate``; ``export``:
  ``worldlm-export``; ``eval``: ``worldlm-eval``; ``report``: ``worldlm-report``; ``admit``:
  ``worldlm-admit`` (region keys and peer certificates).
"""
