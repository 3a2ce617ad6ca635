"""What `tiergate serve` builds on first use, in the background while it serves: the distilled tiers' models
(`tiergate models distill`, its default budget from the tier catalogue), then the router's difficulty model
(`tiergate router train --if-missing`).

Each build is a child process (torch never enters the gateway), its progress bar on this terminal. Each is
done once: a distillation holds a lock next to its output and resumes its checkpoint if it was interrupted;
the router artifact has its own lock. Until a student is ready its tier is reported as preparing (with the
build's progress) and routed around.
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import sys
import threading

from assets.builds import is_building
from assets.model_source import is_prepared, resolve_model
from assets.parent_watch import die_with_parent
from gateway.settings import Settings
from tiers.catalogue import TierCatalogue

log = logging.getLogger("tiergate.first_use")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli.main", *args]


def build_commands(settings: Settings, catalogue: TierCatalogue) -> list[list[str]]:
    """The child commands still needed, in order (empty when everything is built or being built elsewhere)."""
    models = settings.resolved_models_dir
    common = ["--models-dir", str(models), "--data-dir", str(settings.data_dir)]
    out: list[list[str]] = []
    for tier in catalogue.tiers.values():
        if tier.distill is None or is_prepared(tier.model, models):
            continue
        if is_building(resolve_model(tier.model, models)):
            log.info("tier %s: its model is being built by another process; waiting for it", tier.name)
            continue
        out.append(_cli("models", "distill", "--teacher", tier.distill.teacher, "--tiers", str(settings.tiers_file),
                        *common))
    if settings.build_router_model:
        out.append(_cli("router", "train", "--if-missing", "--catalogue", str(settings.tiers_file), *common))
    return out


def start_background_builds(settings: Settings, catalogue: TierCatalogue) -> threading.Thread | None:
    """Run the missing builds one after another in a daemon thread; children end with the gateway.

    They end with it even when it is SIGKILLed: each child gets the parent-death signal (assets/parent_watch.py).
    """
    if not settings.build_missing_models:
        return None
    commands = build_commands(settings, catalogue)
    if not commands:
        return None
    running: list[subprocess.Popen[bytes]] = []

    def stop_children() -> None:
        for proc in running:
            if proc.poll() is None:
                proc.terminate()  # a distillation resumes from its last checkpoint next time

    def run() -> None:
        for cmd in commands:
            log.info("first use: tiergate %s", " ".join(cmd[3:]))
            # spawned and waited for from this thread, which outlives the child as die_with_parent requires
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())
            running.append(proc)
            if proc.wait() != 0:
                log.error("first-use build failed (exit %s): %s", proc.returncode, " ".join(cmd[3:]))

    atexit.register(stop_children)
    thread = threading.Thread(target=run, name="first-use-builds", daemon=True)
    thread.start()
    return thread
