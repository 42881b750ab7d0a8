"""The harness every method script shares, nothing method-specific: config.py (Args, presets,
checks), run.py (the run directory, checkpoints, resume), model.py (loading, LoRA, log-probs),
generation.py (the rollout backends), envbatch.py (many games at once), dist.py (data parallel)."""

import json
import os


class UsageError(Exception):
    """Bad input from the user (unknown model or env, missing data): the scripts print the message
    and exit with status 2, without a traceback."""


class RunStopped(Exception):
    """A run that cannot go on (a non-finite loss, a checkpoint that cannot be written): the
    scripts print the message and exit with status 1; the last checkpoint is intact."""


def write_text(path: str, text: str) -> None:
    """`text` at `path`, whole or not at all: written beside it, then renamed over it."""
    partial = f"{path}.partial"
    try:
        with open(partial, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:  # a full disk, say: no half-written file is left beside it
        if os.path.exists(partial):
            os.remove(partial)
        raise


def folder_error(flag: str, folder: str) -> str | None:
    """Why `folder` cannot be, or be made, a writable directory (checked before the work), or
    None when it can."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{flag} {folder}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {folder}: {existing} is not writable"
    return None


def write_json(path: str, value) -> None:
    """`value` as JSON at `path`, whole or not at all (write_text)."""
    write_text(path, json.dumps(value, indent=1))
