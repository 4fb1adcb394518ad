"""The ``lowmem-tpu`` command line: parse, load the recipe, call one library function.

``common`` holds the typer app and what every command shares; each other module registers its
commands on it, in the order ``--help`` lists them: ``train`` (validate, show, sft, memory,
compare), ``use`` (generate, chat, eval), ``publish`` (merge, push) and ``tools`` (recipes, doctor).
"""

# isort: off
from lowmem_tpu.cli import train, use, publish, tools  # noqa: F401  (registers the commands, in this order)
from lowmem_tpu.cli.common import app

# isort: on


def main() -> None:
    app(prog_name="lowmem-tpu")


__all__ = ["app", "main"]
