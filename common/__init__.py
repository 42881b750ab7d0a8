"""The thin layer every method script shares: model + LoRA loading (model.py), generation through
transformers or vLLM (generation.py) and stepping many games at once (envbatch.py). Nothing
method-specific lives here."""


class UsageError(Exception):
    """Bad input from the user (unknown model or env, missing data): the scripts print the message
    and exit with status 2, without a traceback."""


class RunStopped(Exception):
    """A run that cannot go on (a non-finite loss, a checkpoint that cannot be written): the
    scripts print the message and exit with status 1; the last checkpoint is intact."""
