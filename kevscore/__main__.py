"""The `kevscore` command and `python -m kevscore`: the CLI, with a Ctrl-C at any moment (start-up
included) ending it on one line, exit status 130."""
import signal
import sys


def main() -> None:
    try:
        with _deferred_interrupt():
            # A SIGINT inside a C extension's import can surface as an ImportError that a library catches
            # and works around: the heavy imports run with it held, and it is raised once they are done.
            from kevscore import job  # noqa: F401  (numpy, pyarrow, torch)
            from kevscore.cli import main as cli_main
        cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None


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
