"""``python -m dschat.cli ...`` is ``dschat ...``."""

from dschat.cli.main import cli

if __name__ == "__main__":
    cli()
