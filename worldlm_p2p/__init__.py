"""WorldLM-P2P: federations of federations for language-model pre-training on hivemind.

Importing the package does nothing beyond defining names (no logging setup, no heavy imports).
Map of the package:

- ``config``: frozen config dataclasses (model, tokenizer, training, averaging, run manifest, peer).
- ``aggregation``: pure aggregation math (torch only).
- ``checkpoint``: atomic checkpoints and resume.
- ``train/``: model presets, tokenizer, data loading, the local inner loop (no networking).
- ``net/``: hivemind DHT, signed records, run manifest, region all-reduce (no transformers/datasets).
- ``peer``, ``bootstrap``, ``swarm``: orchestration; ``cli/``: thin command-line entry points.
"""

__version__ = "0.1.0"
