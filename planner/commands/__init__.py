"""One module per ``autopar`` subcommand; each defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. ``planner.cli`` lists them in ``COMMANDS``."""
