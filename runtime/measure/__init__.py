"""Measuring this machine and plans on it: ``calibrate`` (the profile ``autopar calibrate`` writes: ``device``,
``compute``, ``collectives``), ``validate`` (a plan's measured steps), ``spawn`` (the one way local ranks are
started and collected). Nothing here is imported by ``runtime.apply_plan``."""
