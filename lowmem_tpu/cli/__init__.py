"""The ``lowmem-tpu`` command line: parse, load the recipe, call one library function.

``common`` holds the typer app and what every command shares; each other module registers the commands of
one thing a user does, in the order ``--help`` lists them: ``train`` (sft, dpo, plot, doctor), ``recipe``
(validate, show, data, recipes), ``plan`` (memory, compare, tune), ``use`` (generate, chat, eval) and
``publish`` (export, merge, push).
"""

# isort: off
from lowmem_tpu.cli import train, recipe, plan, use, publish  # noqa: F401  (registers the commands, in this order)
from lowmem_tpu.cli.common import app

# isort: on


class Interrupted(BaseException):
    """Ctrl-C outside training. Not a KeyboardInterrupt: click would turn that into "Aborted!" and exit 1."""


def main() -> None:
    """Every command: Ctrl-C ends it with "interrupted" and exit 130, no traceback; outputs are built beside
    their place and renamed in, so an interrupted merge, eval or compare leaves no half-written result.
    (``sft`` puts its own handler in place while it trains: the first Ctrl-C saves, then stops.)"""
    import signal
    import sys
    import threading

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupt)
    try:
        app(prog_name="lowmem-tpu")
    except Interrupted:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


__all__ = ["app", "main"]
