"""The local-training layer: everything one peer needs to train a model on its own data.
It knows nothing about peers or networking and never imports hivemind.

- ``tokenizer``: :class:`ByteTokenizer` (UTF-8 bytes + BOS/EOS/PAD), :class:`LocalHFTokenizer`
  (a local Hugging Face tokenizer directory), :func:`load_tokenizer`.
- ``model``: :func:`build_model` (a ``transformers`` Llama from a ``ModelConfig``, seeded init),
  :func:`count_parameters`, :func:`expected_parameters`, :func:`resolve_device`,
  :func:`autocast_context`.
- ``data``: :func:`load_texts` (corpus leaf / text dir / saved ``datasets`` dir / single file),
  :func:`tokenize_splits`, :func:`sample_batch` (pure function of seed and step),
  :func:`eval_batches`, :func:`hold_out_tune` (the tune slice for evidence).
- ``corpus``: the federated layout: :func:`list_corpus`, :func:`read_grouping` (regroupings by a
  grouping file), :func:`demo_data_dir` (the bundled slice).
- ``trainer``: :class:`LocalTrainer` (AdamW, warmup, clipping, bf16 autocast on CUDA),
  :class:`SliceEvaluator` (its tune-slice losses on a copy of its model, for another thread),
  :func:`get_flat_params` / :func:`set_params` for the averaging layer.
- ``dp``: :class:`DPSGDConfig` (``LocalTrainer(..., dp=DPSGDConfig(...))`` runs DP-SGD with Opacus:
  per-window clipping, Gaussian noise, Poisson sampling, an RDP accountant), :class:`DPSGD`,
  :func:`peer_dp_config` (the config from settings where 0 means off).
- ``dp_sampling``: the Poisson sampling of training windows that DP-SGD's accountant assumes.

Importing this package is cheap: ``transformers``, ``datasets`` and ``opacus`` are imported on first use.
"""

from worldlm_p2p.train.corpus import demo_data_dir, list_corpus, read_grouping
from worldlm_p2p.train.data import (
    TextSplits,
    TokenData,
    eval_batches,
    hold_out_tune,
    load_texts,
    peer_data_seed,
    sample_batch,
    tokenize_splits,
)
from worldlm_p2p.train.dp import DPSGD, DPSGDConfig, peer_dp_config
from worldlm_p2p.train.model import (
    autocast_context,
    build_model,
    count_parameters,
    expected_parameters,
    resolve_device,
)
from worldlm_p2p.train.tokenizer import ByteTokenizer, LocalHFTokenizer, Tokenizer, load_tokenizer
from worldlm_p2p.train.trainer import (
    LocalTrainer,
    SliceEvaluator,
    StepResult,
    resolve_steps,
    bits_per_byte,
    get_flat_params,
    lr_at,
    set_params,
)

__all__ = [
    "ByteTokenizer",
    "LocalHFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "build_model",
    "count_parameters",
    "expected_parameters",
    "resolve_device",
    "autocast_context",
    "TextSplits",
    "TokenData",
    "load_texts",
    "tokenize_splits",
    "sample_batch",
    "peer_data_seed",
    "eval_batches",
    "hold_out_tune",
    "demo_data_dir",
    "list_corpus",
    "read_grouping",
    "LocalTrainer",
    "SliceEvaluator",
    "StepResult",
    "resolve_steps",
    "lr_at",
    "bits_per_byte",
    "get_flat_params",
    "set_params",
    "DPSGDConfig",
    "DPSGD",
    "peer_dp_config",
]
