"""The `exgrpo` command line (`exgrpo_cli.main:app`): a thin Typer layer over `exgrpo_client`."""
