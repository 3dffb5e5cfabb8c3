"""Cost model: hardware and cluster description, compute / communication / memory estimates.

Pure functions of (sizes, Cluster). Imports numpy and its own modules only: never planner or runtime.
"""
