"""One module per ``autopar`` subcommand; each defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. ``cli.main`` lists them in ``COMMANDS``."""
