"""The `kevscore` command: the CLI, with a Ctrl-C at any moment ending it on one line (exit status 130).

Also `python -m kevscore`; a Ctrl-C during the start-up's imports ends it the same way."""
import signal
import sys


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        # the CLI's imports (every command's modules: numpy, pyarrow, torch) take a second or more before the
        # progress display can start
        if line := starting_line(sys.argv[1:], sys.stderr.isatty()):
            print(line, end="", file=sys.stderr, flush=True)
        # A SIGINT inside a C extension's import can surface as an ImportError that a library catches and works
        # around: the heavy imports run with it blocked, and one that arrived is delivered once they are done.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            from kevscore.cli import app
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        app()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler's stop) ends a command as Ctrl-C does


def starting_line(args: list[str], terminal: bool) -> str | None:
    """What `kevscore run` shows on a terminal before its imports: the progress display then writes over it.
    Nothing where nothing else is shown (--quiet, --log-json, --help) or where stderr is not a terminal."""
    quiet = {"--quiet", "--log-json", "--help", "-h", "--dry-run"}
    return "kevscore: starting\r" if terminal and args[:1] == ["run"] and not quiet & set(args) else None


if __name__ == "__main__":
    main()
