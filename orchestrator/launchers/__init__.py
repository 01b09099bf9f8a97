"""Launchers: how a trial's spec becomes a record on a Ray worker (see :mod:`.base`)."""

from __future__ import annotations

from .base import Launcher, LaunchSettings, Outcome, TrialDied, compile_cache_dir
from .prestart import claim
from .process import ProcessLauncher
from .warm import WarmLauncher

LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (ProcessLauncher, WarmLauncher)}
DEFAULT_LAUNCHER = "warm"
DEFAULT_WARM_MAX_TRIALS = 32


def make_launcher(settings: LaunchSettings) -> Launcher:
    """The sweep's launcher, adopting the driver's prestarted trial servers (:mod:`.prestart`) when it has some."""
    return LAUNCHERS[settings.launcher](settings, adopt=claim)


__all__ = ["DEFAULT_LAUNCHER", "DEFAULT_WARM_MAX_TRIALS", "LAUNCHERS", "LaunchSettings", "Launcher", "Outcome",
           "TrialDied", "compile_cache_dir", "make_launcher"]
