"""Typed, frozen configuration.

The **run manifest** (:class:`RunManifest`) is what every peer of a run must agree on: the model
architecture, the tokenizer, the training hyper-parameters, the aggregation strategy and the
averaging timings. A bootstrap node publishes it from a TOML file; peers fetch it from the DHT.
Local, per-peer settings (region, data, devices, addresses) live in :class:`PeerConfig`.

All dataclasses are frozen and keyword-only, and validate themselves in ``__post_init__`` with a
:class:`~worldlm_p2p.errors.ConfigError` that names the offending setting.

Modules (``tests/unit/test_layering.py`` checks that this map names every one): ``run`` (the run
manifest and its sections: model, tokenizer, training, aggregation, averaging, privacy policy;
the shared validation helpers) and ``local`` (a region's privacy settings, the DHT join, the
peer's own settings). Everything is importable from here.
"""

from worldlm_p2p.config.local import NetConfig, PeerConfig, PrivacyConfig, privacy_violations
from worldlm_p2p.config.run import (MODEL_PRESETS, NAME_RULE, AdmissionPolicy, AggregationConfig, AveragingConfig, ModelConfig, PrivacyPolicy,
                                    RunManifest, TokenizerSpec, TrainConfig, _build_section, _finite, _require,
                                    check_name, load_toml, manifest_conflicts, model_preset)

__all__ = ["MODEL_PRESETS", "NAME_RULE", "AdmissionPolicy", "AggregationConfig", "AveragingConfig", "ModelConfig", "NetConfig", "PeerConfig",
           "PrivacyConfig", "PrivacyPolicy", "RunManifest", "TokenizerSpec", "TrainConfig", "check_name", "load_toml",
           "manifest_conflicts", "model_preset", "privacy_violations"]
