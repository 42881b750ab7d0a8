"""The harness every method script shares, nothing method-specific: config.py (Args, presets,
checks), run.py (the run directory, checkpoints, resume), model.py (loading, LoRA, log-probs),
generation.py (the rollout backends), envbatch.py (many games at once), dist.py (data parallel)."""

import contextlib
import json
import os


class UsageError(Exception):
    """Bad input from the user (unknown model or env, missing data): the scripts print the message
    and exit with status 2, without a traceback."""


class RunStopped(Exception):
    """A run that cannot go on (a non-finite loss, a checkpoint that cannot be written): the
    scripts print the message and exit with status 1; the last checkpoint is intact."""


def error_line(e: BaseException, empty: str = "") -> str:
    """A library's error in one line of ours: "TypeName: the first line of its message" (`empty`
    in place of a message it does not have)."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else empty}"


@contextlib.contextmanager
def written_whole(path: str):
    """Writes a file at `path` whole or not at all: the block writes the path it is given, beside
    `path` and this process's own (two processes may write one file), which is renamed over
    `path` when the block ends, and removed when it fails (a full disk, say)."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        yield partial
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def write_text(path: str, text: str) -> None:
    """`text` at `path`, whole or not at all (written_whole), flushed to disk before the rename."""
    with written_whole(path) as partial, open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def folder_error(flag: str, folder: str, writable: bool = True) -> str | None:
    """Why `folder` cannot be, or be made, a directory (`writable`: one this process can write
    in), checked before the work; None when it can."""
    existing = os.path.abspath(folder)
    while not os.path.lexists(existing):  # a link to nowhere stops here: not a directory
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        kind = "a link to nowhere" if os.path.islink(existing) else "a file"
        return f"{flag} {folder}: {existing} is {kind}, not a directory"
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {folder}: {existing} is not writable"
    return None


def write_json(path: str, value) -> None:
    """`value` as JSON at `path`, whole or not at all (write_text)."""
    write_text(path, json.dumps(value, indent=1))
