"""How a command-line failure reaches the user: one line, a documented exit code, no stack.

Every ``elastic-emb`` command (and ``python -m elastic_emb.drill``) runs through
:func:`run_command`; a failure the user can cause is raised as :class:`UserError`, naming the
input and the remedy. Exit codes: 0 ok, 1 negative verdict, 2 bad input or unreachable store,
3 timed out, 70 internal error, 130 interrupted. ``--debug`` (or ``ELASTIC_EMB_DEBUG=1``) shows
the stack instead.

Design: ``docs/LIFECYCLE.md`` (section "Errors and exit codes").
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

DEBUG_ENV = "ELASTIC_EMB_DEBUG"
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2 only


class UserError(click.ClickException):
    """A failure the user can fix: the message names the input at fault and the remedy.

    Args:
        message: the one-line message.
        exit_code: the process's exit code (2, bad input, unless given).
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        ctx = click.get_current_context(silent=True)
        self.where = ctx.command_path if ctx is not None else None


def debug_enabled() -> bool:
    """Whether stacks are shown: ``ELASTIC_EMB_DEBUG``, which ``--debug`` sets.

    Returns:
        True when debugging is on; a malformed value counts as off.
    """
    from elastic_emb.config import load
    from elastic_emb.errors import ConfigError

    try:
        return load(None, "debug").debug
    except ConfigError:
        return False


def quiet_torch() -> None:
    """For a command that talks to a store and reports its own one-line error: before torch is
    imported, keep torch's C++ side quiet unless debugging. TCPStore logs every failed connect
    attempt with the C++ frames of its exception (``TORCH_CPP_LOG_LEVEL``), and its Python
    exceptions carry them too (``TORCH_SHOW_CPP_STACKTRACES``). Not applied to the drill, whose
    agents' logs should keep torch's warnings."""
    if not debug_enabled():
        os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def one_line(text: str, limit: int = 600) -> str:
    """The text on one line (newlines folded), at most ``limit`` characters.

    Args:
        text: the text (anything ``str`` accepts).
        limit: the most characters kept; a longer text ends with ``...``.

    Returns:
        The folded text.
    """
    flat = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _say(prog: str, message: str) -> None:
    click.echo(f"{prog}: error: {one_line(message)}", err=True)


def run_command(
    command: click.Command, args: list[str] | None = None, prog_name: str | None = None, **extra: Any
) -> None:
    """Run a click command or group; turn every failure into one line and an exit code.

    Args:
        command: the click command or group.
        args: the arguments; None takes ``sys.argv[1:]``.
        prog_name: the program name in messages; None is ``elastic-emb``.
        **extra: passed on to the command's ``main``.

    Raises:
        SystemExit: always, with the command's return value or the code of its failure (2 usage,
            the :class:`UserError`'s code, 70 internal error, 130 interrupted).
    """
    argv = list(sys.argv[1:] if args is None else args)
    if "--debug" in argv[: max(1, argv.index("--") if "--" in argv else len(argv))]:
        os.environ[DEBUG_ENV] = "1"
    prog = prog_name or "elastic-emb"
    try:
        rv = command.main(args=argv, prog_name=prog, standalone_mode=False, **extra)
    except _NO_ARGS_IS_HELP as exc:  # click >= 8.2: a group run without a command shows its help
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(EXIT_OK)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx else prog
        _say(where, f"{exc.format_message()} (see '{where} --help')")
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        _say(getattr(exc, "where", None) or _where(command, prog, argv), exc.format_message())
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the last resort: reported in one line, stack on request
        if debug_enabled():
            raise
        _say(
            _where(command, prog, argv),
            f"internal error {type(exc).__name__}: {exc} -- this is a bug; rerun with --debug "
            f"(or {DEBUG_ENV}=1) for the stack and report it",
        )
        sys.exit(EXIT_INTERNAL)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def _where(command: click.Command, prog: str, argv: list[str]) -> str:
    """``prog`` and the subcommand named in ``argv`` (the context is gone once main returns)."""
    names = getattr(command, "commands", {})
    sub = next((a for a in argv if a in names), None)
    return f"{prog} {sub}" if sub else prog
