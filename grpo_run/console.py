"""The `grpo-run` command: a stop signal is kept from its first line (`early_signal`), then the CLI."""

from grpo_run import early_signal


def main() -> None:
    early_signal.catch()  # before the imports below, which take seconds
    from grpo_run.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
