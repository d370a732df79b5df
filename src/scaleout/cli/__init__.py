"""The ``scaleout`` command: one module per subcommand, each a parser + handler pair."""
