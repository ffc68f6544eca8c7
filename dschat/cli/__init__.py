"""The CLI layer: every ``dschat`` subcommand, one module each, plus the option machinery (``options``).

Command modules only parse, call the library and print. Nothing outside ``dschat.cli`` imports this package
(``tests/dschat/test_imports.py`` checks it); the stage mains import ``dschat.cli.options`` to build their
commands.
"""
