"""One module per CLI command: NAME, HELP, add_arguments(parser), run(args) -> exit status."""
