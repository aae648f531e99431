"""The dependency rule: pure math imports torch only, net/ never imports transformers or datasets,
train/ never imports hivemind, and importing the package does nothing heavy."""

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import worldlm_p2p

PACKAGE = Path(worldlm_p2p.__file__).parent
# the pure math: torch, the standard library and each other only
PURE = ("split", "aggregation", "compression", "attention", "residual", "mixing", "outer_optim", "privacy", "rounds", "checkpoint",
        "codec", "robust")
# besides the pure modules themselves: the settings (config, their literals, the strategies), which
# import the standard library only
PURE_MAY_USE = {"errors", "config", "kinds", "strategies"}


CASES = [
    ("worldlm_p2p", ["torch", "hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.aggregation", ["hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.split, worldlm_p2p.attention, worldlm_p2p.outer_optim, worldlm_p2p.residual, worldlm_p2p.rounds, "
     "worldlm_p2p.mixing, worldlm_p2p.privacy, worldlm_p2p.robust",
     ["hivemind", "transformers", "datasets", "pydantic", "msgpack"]),  # (torch itself imports asyncio and numpy)
    ("worldlm_p2p.simulate", ["hivemind"]),
    ("worldlm_p2p.config, worldlm_p2p.kinds, worldlm_p2p.strategies", ["torch", "hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.checkpoint, worldlm_p2p.codec", ["hivemind", "transformers", "datasets"]),
    ("worldlm_p2p.net.records, worldlm_p2p.net.averaging, worldlm_p2p.net.barrier, worldlm_p2p.net.dht, "
     "worldlm_p2p.net.leader, worldlm_p2p.net.world, worldlm_p2p.net.monitor, worldlm_p2p.net.reader, "
     "worldlm_p2p.net.keys, worldlm_p2p.net.hivemind_compat, worldlm_p2p.net.robust_allreduce",
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


def _imports(path: Path) -> set[str]:
    """The modules a file imports (absolute names; relative imports are not used in the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            if node.module == "worldlm_p2p":
                out |= {f"worldlm_p2p.{a.name}" for a in node.names}
    return out


def test_pure_math_imports_torch_the_standard_library_and_itself_only():
    """Static, so that a module torch happens to load (numpy) cannot hide an import of it."""
    allowed_own = {f"worldlm_p2p.{m}" for m in (*PURE, *PURE_MAY_USE)} | {"worldlm_p2p"}
    bad = {}
    for m in PURE:
        for name in _imports(PACKAGE / f"{m}.py"):
            top = name.split(".")[0]
            ok = (top in sys.stdlib_module_names or top == "torch" or top == "__future__"
                  or (top == "worldlm_p2p" and name in allowed_own))
            if not ok:
                bad.setdefault(m, []).append(name)
    assert not bad, bad


def test_package_maps_name_every_module():
    """Each package's docstring names every one of its modules (the map a newcomer reads first)."""
    missing = {}
    for pkg in (PACKAGE, PACKAGE / "net", PACKAGE / "train", PACKAGE / "cli", PACKAGE / "peer", PACKAGE / "config"):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())) or ""
        for info in pkgutil.iter_modules([str(pkg)]):
            if f"``{info.name}``" not in doc and f"``{info.name}/``" not in doc:
                missing.setdefault(pkg.name, []).append(info.name)
    assert not missing, missing


def test_dht_keys_and_averager_prefixes_are_composed_in_one_module():
    """``net/keys.py`` names every key and prefix; a key composed elsewhere is a second definition."""
    import re

    pattern = re.compile(r"""f["']\{run_id\}_|["']_(progress|leaders|residuals|runs)["']|["']worldlm_runs["']""")
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "net" / "keys.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not bad, bad
