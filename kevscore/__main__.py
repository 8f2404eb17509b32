"""The `kevscore` command: the CLI, with a Ctrl-C at any moment ending it on one line (exit status 130).

Also `python -m kevscore`; a Ctrl-C during the start-up's imports ends it the same way."""
import signal
import sys


def main() -> None:
    try:
        # the CLI's imports (every command's modules: numpy, pyarrow, torch) take a second or more before the
        # progress display can start
        if line := starting_line(sys.argv[1:], sys.stderr.isatty()):
            print(line, end="", file=sys.stderr, flush=True)
        with _deferred_interrupt():
            # A SIGINT inside a C extension's import can surface as an ImportError that a library catches
            # and works around: the heavy imports run with it held, and it is raised once they are done.
            from kevscore.cli import app
        app()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None


def starting_line(args: list[str], terminal: bool) -> str | None:
    """What `kevscore run` shows on a terminal before its imports: the progress display then writes over it.
    Nothing where nothing else is shown (--quiet, --log-json, --help) or where stderr is not a terminal."""
    quiet = {"--quiet", "--log-json", "--help", "-h", "--dry-run"}
    return "kevscore: starting\r" if terminal and args[:1] == ["run"] and not quiet & set(args) else None


class _deferred_interrupt:
    """Hold SIGINT while active; raise KeyboardInterrupt on leaving when one arrived."""

    def __enter__(self):
        self.arrived, self.previous = False, signal.signal(signal.SIGINT, self._hold)

    def _hold(self, signum, frame) -> None:
        self.arrived = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)
        if self.arrived and exc[0] is None:
            raise KeyboardInterrupt


if __name__ == "__main__":
    main()
