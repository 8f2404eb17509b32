"""The `kevscore` command and `python -m kevscore`: the CLI, with a Ctrl-C at any moment (imports included)
ending it on one line, exit status 130."""
import sys


def main() -> None:
    try:
        from kevscore.cli import main as cli_main

        cli_main()
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
