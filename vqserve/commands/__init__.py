"""One module per ``vqserve`` subcommand: ``add_parser(parser)`` and ``run(args) -> int``."""
