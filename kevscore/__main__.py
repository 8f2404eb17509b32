"""The `kevscore` command: the CLI, with a Ctrl-C or SIGTERM at any moment ending it on one line (exit status 130).

Also `python -m kevscore`; a Ctrl-C during the start-up's imports ends it the same way."""
import atexit
import contextlib
import os
import signal
import sys

STOPS = (signal.SIGINT, signal.SIGTERM)


def main() -> None:
    # Before this line runs (interpreter start-up, `import kevscore`: ~25 ms) SIGTERM kills as the OS does (143).
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a scheduler's stop ends a command as Ctrl-C does
    for sig in STOPS:  # the last exit functions (registered before the CLI's imports register theirs): see `ended`
        atexit.register(signal.signal, sig, signal.SIG_IGN)
    try:
        # the CLI's imports (every command's modules: numpy, pyarrow, torch) take a second or more before the
        # progress display can start
        if line := starting_line(sys.argv[1:], sys.stderr.isatty()):
            print(line, end="", file=sys.stderr, flush=True)
        # A SIGINT inside a C extension's import can surface as an ImportError that a library catches and works
        # around: the heavy imports run with it blocked, and one that arrived is delivered once they are done.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:
            from kevscore.cli import main as cli
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        code = cli()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        code = 130
    ended(code)
    sys.exit(code)


def ended(code: int) -> None:
    """The command has ended with exit status `code`, its last line printed: a SIGINT or SIGTERM from here on ends
    the process at once with that status (not as an interrupt of work that is done). Python's exit may wait for a
    GPU warm-up thread, then runs the exit functions, then puts back the OS's default actions for its teardown
    (0.4 s with torch): the last exit functions ignore both signals there."""
    with contextlib.suppress(OSError):  # a closed pipe: what it had is lost anyway
        sys.stdout.flush()
        sys.stderr.flush()
    for sig in STOPS:
        signal.signal(sig, lambda signum, frame: os._exit(code))


def starting_line(args: list[str], terminal: bool) -> str | None:
    """What `kevscore run` shows on a terminal before its imports: the progress display then writes over it.
    Nothing where nothing else is shown (--quiet, --log-json, --help) or where stderr is not a terminal."""
    quiet = {"--quiet", "--log-json", "--help", "-h", "--dry-run"}
    return "kevscore: starting\r" if terminal and args[:1] == ["run"] and not quiet & set(args) else None


if __name__ == "__main__":
    main()
