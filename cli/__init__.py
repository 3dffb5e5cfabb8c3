"""autopar's command line: the top floor, above ``planner`` and ``runtime``; the only code that prints."""
