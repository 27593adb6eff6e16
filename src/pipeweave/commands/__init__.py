"""The ``pipeweave`` subcommands, one module each with ``add_parser`` and ``run``."""
