"""The dependency rule: pure math imports torch only, net/ never imports transformers or datasets,
train/ never imports hivemind, and importing the package does nothing heavy."""

import subprocess
import sys


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


def test_imports_respect_layers():
    """Each case in a fresh interpreter (imports leave modules behind), all started at once: the
    interpreters' start-up is most of the cost."""
    procs = []
    for modules, forbidden in CASES:
        code = f"import sys; import {modules}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
        procs.append((modules, subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE, text=True)))
    failures = []
    for modules, p in procs:
        out, err = p.communicate(timeout=180)
        if p.returncode != 0:
            failures.append(f"{modules}: exit {p.returncode}: {err.strip().splitlines()[-1:]}")
        elif out.strip():
            failures.append(f"{modules} imported {out.strip()}")
    assert not failures, failures


def test_train_layer_builds_models_without_hivemind():
    code = ("import sys; from worldlm_p2p.config import MODEL_PRESETS; from worldlm_p2p.train import build_model;"
            "build_model(MODEL_PRESETS['tiny'], vocab_size=259, seed=0); print('hivemind' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
