"""One MiniGPT trial on one device: no Ray, no Parquet. See :func:`run_trial`."""

from .record.fields import FIELDS, FINAL_STATUSES, SCHEMA_VERSION, STATUSES
from .spec import SpecError, TrialSpec

__all__ = ["FIELDS", "FINAL_STATUSES", "SCHEMA_VERSION", "STATUSES", "SpecError", "TrialSpec", "run_trial"]


def run_trial(spec, capability=None):
    """Run one trial (imports torch lazily so that ``import trials`` stays cheap)."""
    from .trial import run_trial as _run

    return _run(spec, capability)
