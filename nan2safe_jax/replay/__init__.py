"""Tier 2: jaxpr replay localizer.

``locate(jaxpr, args)`` names the first equation whose output is non-finite while its inputs are
finite; ``locate_step(step_fn, *args)`` traces a (jitted) step and does the same.
"""

from nan2safe_jax.replay.locate import locate, locate_replayed, locate_step
from nan2safe_jax.replay.report import DIAGNOSES, NOT_REPRODUCIBLE, EqnRef, Report

__all__ = [
    "DIAGNOSES",
    "NOT_REPRODUCIBLE",
    "EqnRef",
    "Report",
    "locate",
    "locate_replayed",
    "locate_step",
]
