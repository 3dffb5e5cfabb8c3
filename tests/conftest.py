"""Shared pytest fixtures. Tiers: unit (pure), planner (fake process group), distributed (gloo ranks), slow, gpu."""

import os

# Keep intra-op threads low: the machine has 2 cores and distributed tests spawn several ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")
