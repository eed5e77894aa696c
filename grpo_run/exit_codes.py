"""The exit codes of `grpo-run`, declared once: a scheduler or a script tells what happened from the code
alone (docs/reliability.md lists them). No imports: the command reads these before anything heavy loads."""

# The run failed: its cause is the log's last line.
EXIT_FAILED = 1

# A bad config (a value, a missing key, an override Hydra cannot compose): nothing ran, fix and rerun.
EXIT_CONFIG_ERROR = 2

# mode=plan: the run does not fit (`grpo-run mode=plan ... && grpo-run ...` stops here).
EXIT_DOES_NOT_FIT = 3

# sysexits' EX_UNAVAILABLE: a rank's collective timed out or its peer went away; the launcher tells
# this from a crash and names the rank that stopped answering.
EXIT_LOST_CONTACT = 69

# sysexits' EX_TEMPFAIL, "try again later": a checkpoint was saved and `resume=auto` continues the run.
EXIT_PREEMPTED = 75

# Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130
