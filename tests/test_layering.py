"""The dependency rule: pure math imports torch only, net/ never imports transformers or datasets,
train/ never imports hivemind, and importing the package does nothing heavy."""

import subprocess
import sys

import pytest

CASES = [
    ("worldlm_p2p", ["torch", "hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.aggregation", ["hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.split, worldlm_p2p.attention, worldlm_p2p.outer_optim, worldlm_p2p.residual, worldlm_p2p.rounds, "
     "worldlm_p2p.mixing",
     ["hivemind", "transformers", "datasets"]),  # (torch itself imports asyncio)
    ("worldlm_p2p.simulate", ["hivemind"]),
    ("worldlm_p2p.config", ["torch", "hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.checkpoint", ["hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.net.records, worldlm_p2p.net.averaging, worldlm_p2p.net.barrier, worldlm_p2p.net.dht, "
     "worldlm_p2p.net.leader",
     ["transformers", "datasets"]),
    ("worldlm_p2p.train", ["hivemind"]),
]


@pytest.mark.parametrize("modules, forbidden", CASES, ids=[c[0].split(",")[0] for c in CASES])
def test_imports_respect_layers(modules, forbidden):
    code = f"import sys; import {modules}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{modules} imported {out.stdout.strip()}"


def test_train_layer_builds_models_without_hivemind():
    code = ("import sys; from worldlm_p2p.config import MODEL_PRESETS; from worldlm_p2p.train import build_model;"
            "build_model(MODEL_PRESETS['tiny'], vocab_size=259, seed=0); print('hivemind' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
