"""Many games stepped in lock-step: one model call chooses the actions of every game still running,
then each of those games takes its step. A finished game produces no more steps (no padding)."""

from __future__ import annotations


class EnvBatch:
    def __init__(self, games: list):
        self.games = games
        self.observations: list[str] = []
        self.done: list[bool] = []
        self.won: list[bool] = []

    def reset(self) -> list[str]:
        self.observations = [g.reset() for g in self.games]
        self.done = [False] * len(self.games)
        self.won = [False] * len(self.games)
        return self.observations

    def active(self) -> list[int]:
        """Indices of the games still running."""
        return [i for i, d in enumerate(self.done) if not d]

    def step(self, actions: dict[int, str]) -> dict[int, tuple[str, float, bool, dict]]:
        """Step game i with actions[i] for every running i; returns
        {i: (obs, reward, done, info)}."""
        results = {}
        for i, command in actions.items():
            if self.done[i]:
                raise ValueError(f"game {i} is finished")
            obs, reward, done, info = self.games[i].step(command)
            self.observations[i], self.done[i], self.won[i] = obs, done, bool(info["won"])
            results[i] = (obs, reward, done, info)
        return results
