"""Running untrusted code: a sandboxed child process per program (see docs/sandbox.md).

- `runner`: `run_sandboxed(source, limits=..., isolation=...)` -> `SandboxResult` (the parent's side).
- `_child.py`: the child's side, run as a stdlib-only script.
- `reward`: `code_exec`, the reward function that runs HumanEval-style tests through it.
"""
