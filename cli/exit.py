"""Exit status of every ``autopar`` command, as the Unix tools that answer a question use it (diff, cmp, grep)."""

EXIT_OK = 0
EXIT_NO = 1
"""The command worked and its answer is no: ``estimate``: does not fit; ``validate``: a plan outside the
tolerance; ``diff``: the plans differ (as diff(1) and cmp(1) exit)."""
EXIT_ERROR = 2
"""Bad input or an impossible request (an autopar error, or a usage error from argparse)."""
EXIT_INTERRUPTED = 130

EPILOG = """exit status: 0 ok; 1 the answer is no (estimate: does not fit, validate: a plan outside the tolerance,
diff: the plans differ); 2 error (bad input, no feasible plan, usage); 130 interrupted"""
