"""A whole WorldLM world on one machine: one bootstrap node and peers as separate processes.

:class:`LocalSwarm` starts ``worldlm-bootstrap`` and one ``worldlm-peer`` per requested peer on
127.0.0.1, each peer on one sub-corpus of its region (federated layout
``<region>/<sub_corpus>/{train.txt,valid.txt}``), waits for them, and collects their summaries.
The processes are the real CLIs, exactly as a user would start them on separate machines.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from worldlm_p2p.codec import json_safe
from worldlm_p2p.config import RunManifest, check_name
from worldlm_p2p.errors import ConfigError, DataError
from worldlm_p2p.train.corpus import list_corpus

logger = logging.getLogger(__name__)


def parse_regions(spec: str) -> dict[str, int]:
    """``"eu=3,na=2"`` -> ``{"eu": 3, "na": 2}``."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, count = part.partition("=")
        if not sep:
            raise ConfigError(f"--regions: {part!r} is not REGION=COUNT (e.g. eu=3,na=2)")
        check_name("region", name.strip())
        try:
            n = int(count)
        except ValueError:
            raise ConfigError(f"--regions: peer count {count!r} of region {name!r} is not an integer") from None
        if n < 1:
            raise ConfigError(f"--regions: region {name!r} needs at least one peer")
        if name.strip() in out:
            raise ConfigError(f"--regions: region {name!r} is listed twice")
        out[name.strip()] = n
    if not out:
        raise ConfigError("--regions: give at least one REGION=COUNT")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmConfig:
    regions: dict[str, int]
    data: Path
    out: Path
    manifest: RunManifest
    max_steps: int | None = None
    max_tokens: int | None = None
    threads_per_peer: int = 1
    startup_timeout: float = 120.0
    stop_timeout: float = 60.0
    checkpoints: bool = True
    device: str = "cpu"  # every peer's --device (cpu, cuda, cuda:N: they may share one GPU)
    # more worldlm-peer flags for some peers, by label (<region>-<sub_corpus>), e.g. ("--slowdown", "2")
    peer_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device != "cpu" and not (self.device == "cuda" or (self.device.startswith("cuda:")
                                                                    and self.device[5:].isdigit())):
            raise ConfigError(f"--device: {self.device!r} is not cpu, cuda or cuda:N")


@dataclass
class PeerProcess:
    label: str
    region: str
    data: Path
    proc: subprocess.Popen
    log_path: Path
    summary_path: Path
    events_path: Path | None = None  # the peer's structured event log (worldlm_p2p.peer.events)
    started: float = field(default_factory=time.monotonic)

    def tail(self, n: int = 1) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])


def _pump(stream, path: Path, lines: "queue.Queue | None" = None) -> None:
    """Copy a child's output to its log file, and its lines to ``lines`` if given."""
    with path.open("ab") as f:
        for line in iter(stream.readline, b""):
            f.write(line)
            f.flush()
            if lines is not None:
                lines.put(line)
    if lines is not None:
        lines.put(b"<eof>")


class LocalSwarm:
    """Starts and supervises the processes of a local world. Use as a context manager."""

    def __init__(self, *, config: SwarmConfig) -> None:
        self.config = config
        self.bootstrap: subprocess.Popen | None = None
        self.initial_peers: list[str] = []
        self.peers: list[PeerProcess] = []
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ start
    def plan(self) -> list[tuple[str, str, Path]]:
        """(region, label, data dir) of every peer: the i-th peer of a region takes its i-th sub-corpus."""
        corpus = list_corpus(self.config.data)
        plan = []
        for region, n in self.config.regions.items():
            if region not in corpus:
                raise DataError(f"region {region!r} has no data in {self.config.data} "
                                f"(regions there: {', '.join(corpus)})")
            subs = corpus[region]
            if n > len(subs):
                raise ConfigError(f"region {region!r} asks for {n} peers but {self.config.data / region} has only "
                                  f"{len(subs)} sub-corpora (one peer per sub-corpus)")
            for i in range(n):
                plan.append((region, f"{region}-{subs[i].name}", subs[i]))
        return plan

    def start(self) -> None:
        cfg = self.config
        plan = self.plan()
        (cfg.out / "logs").mkdir(parents=True, exist_ok=True)
        (cfg.out / "peers").mkdir(parents=True, exist_ok=True)
        (cfg.out / "events").mkdir(parents=True, exist_ok=True)
        run_toml = cfg.out / "run.toml"
        run_toml.write_text(manifest_to_toml(cfg.manifest))
        self._start_bootstrap(run_toml)
        for region, label, data in plan:
            self.peers.append(self._start_peer(region, label, data))
        logger.info("started %d peers in %d regions", len(self.peers), len(cfg.regions))

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        t = str(self.config.threads_per_peer)
        env.update(OMP_NUM_THREADS=t, MKL_NUM_THREADS=t, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   # the processes stop if this one dies, even by SIGKILL (see cli.common)
                   WORLDLM_DIE_WITH_PARENT="1", WORLDLM_PARENT_PID=str(os.getpid()))
        return env

    def _start_bootstrap(self, run_toml: Path) -> None:
        cmd = [sys.executable, "-m", "worldlm_p2p.cli.bootstrap", "--run-config", str(run_toml),
               "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(self.config.out / "bootstrap.id")]
        self.bootstrap = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env(),
                                          start_new_session=True)
        deadline = time.monotonic() + self.config.startup_timeout
        lines: queue.Queue = queue.Queue()
        log = self.config.out / "logs" / "bootstrap.log"
        threading.Thread(target=_pump, args=(self.bootstrap.stdout, log, lines), daemon=True).start()
        line = ""
        while "/p2p/" not in line:  # the multiaddr line comes first, but tolerate warnings before it
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic())).decode(errors="replace").strip()
            except queue.Empty:
                break
            if line == "<eof>":
                break
        self.initial_peers = [tok for tok in line.split() if tok.startswith("/") and "/p2p/" in tok]
        if not self.initial_peers:
            if self.bootstrap.poll() is None:
                _terminate(self.bootstrap)
            tail = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            raise ConfigError(f"bootstrap node did not start within {self.config.startup_timeout:.0f}s: "
                              f"{(tail or ['no output'])[-1][:300]}")
        logger.info("bootstrap node at %s", " ".join(self.initial_peers))
        logger.info("watch it from another terminal: worldlm-monitor --initial-peers %s", " ".join(self.initial_peers))

    def _start_peer(self, region: str, label: str, data: Path) -> PeerProcess:
        cfg = self.config
        log_path = cfg.out / "logs" / f"{label}.log"
        summary = cfg.out / "peers" / f"{label}.json"
        events = cfg.out / "events" / f"{label}.jsonl"
        cmd = [sys.executable, "-m", "worldlm_p2p.cli.peer", "--region", region, "--data", str(data),
               "--label", label, "--initial-peers", *self.initial_peers, "--run-id", cfg.manifest.run_id,
               "--threads", str(cfg.threads_per_peer), "--summary", str(summary), "--device", cfg.device,
               "--events", str(events)]
        if cfg.max_steps:
            cmd += ["--max-steps", str(cfg.max_steps)]
        if cfg.max_tokens:
            cmd += ["--max-tokens", str(cfg.max_tokens)]
        if cfg.checkpoints:
            cmd += ["--checkpoint-dir", str(cfg.out / "checkpoints" / label)]
        cmd += list(cfg.peer_args.get(label, ()))
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(),
                                    start_new_session=True)
        return PeerProcess(label=label, region=region, data=data, proc=proc, log_path=log_path, summary_path=summary,
                           events_path=events)

    # ------------------------------------------------------------------ run / stop
    def running(self) -> list[PeerProcess]:
        return [p for p in self.peers if p.proc.poll() is None]

    def wait(self, poll: float = 0.5, on_tick=None, should_stop=lambda: False) -> None:
        while self.running() and not should_stop():
            if on_tick is not None:
                on_tick()
            time.sleep(poll)

    def stop(self) -> None:
        """SIGTERM every peer (they checkpoint and exit), then the bootstrap; SIGKILL stragglers."""
        for p in self.running():
            _terminate(p.proc)
        deadline = time.monotonic() + self.config.stop_timeout
        for p in self.peers:
            _wait_or_kill(p.proc, deadline)
        if self.bootstrap is not None and self.bootstrap.poll() is None:
            _terminate(self.bootstrap)
            _wait_or_kill(self.bootstrap, time.monotonic() + 15)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ results
    def summary(self) -> dict[str, Any]:
        peers = []
        for p in self.peers:
            entry: dict[str, Any]
            try:
                entry = json.loads(p.summary_path.read_text())
            except (OSError, ValueError):
                entry = dict(region=p.region, label=p.label, error=p.tail() or "no summary written")
            entry["exit_code"] = p.proc.returncode
            entry["log"] = str(p.log_path)
            peers.append(entry)
        return dict(run_id=self.config.manifest.run_id, manifest=self.config.manifest.to_dict(),
                    regions=self.config.regions, wall_seconds=round(time.monotonic() - self._t0, 2),
                    initial_peers=self.initial_peers, peers=peers)

    def write_summary(self) -> Path:
        path = self.config.out / "summary.json"
        tmp = path.with_name(".summary.json.tmp")
        tmp.write_text(json.dumps(json_safe(self.summary()), indent=2, allow_nan=False))
        os.replace(tmp, path)
        return path


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process and its hivemind children (DHT, averager, p2pd)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM the CLI process only: it shuts its own hivemind children down cleanly."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def stop_process_group(proc: subprocess.Popen, *, grace: float = 5.0) -> None:
    """SIGTERM ``proc`` (a CLI started with ``start_new_session=True``: it shuts its own hivemind
    children down cleanly), wait ``grace`` seconds, then SIGKILL whatever is left of its process
    group (its DHT, averager and p2pd processes)."""
    if proc.poll() is None:
        _terminate(proc)
    _wait_or_kill(proc, time.monotonic() + grace)


def _wait_or_kill(proc: subprocess.Popen, deadline: float) -> None:
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait(timeout=10)
    # reap anything left in the process group (p2pd daemons of a killed peer)
    _signal(proc, signal.SIGKILL)


def manifest_to_toml(manifest: RunManifest) -> str:
    """Serialise a manifest as TOML (flat tables of scalars), readable by ``RunManifest.from_toml``."""
    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        return json.dumps(str(v))

    d = manifest.to_dict()
    lines = [f"run_id = {fmt(d.pop('run_id'))}"]
    for section, values in d.items():
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"
