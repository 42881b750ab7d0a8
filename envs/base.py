"""The bookkeeping every game's step() shares."""

from __future__ import annotations


def normalise(command: str) -> str:
    """A command as every game reads it: lowercase, single spaces."""
    return " ".join(command.strip().lower().split())


def begin_step(game, command: str) -> tuple[str, bool]:
    """Count a step of `game` (which has won, steps, max_steps, admissible_actions()) and return
    the normalised command (lowercase, single spaces) and whether it is admissible."""
    if game.won or game.steps >= game.max_steps:
        raise RuntimeError("step() called on a finished game; call reset() first")
    game.steps += 1
    command = normalise(command)
    return command, command in game.admissible_actions()
