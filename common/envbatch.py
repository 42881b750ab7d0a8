"""Many games stepped in lock-step: one model call chooses the actions of every game still running,
then each of those games takes its step (a finished game takes no more). Games may live in worker
processes (RemoteGame, from a WorkerPool), for a slow engine such as ALFWorld's
(docs/environments.md): EnvBatch sends every game its reset or step before it awaits any answer,
so the workers play at once."""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import time
import traceback

from common import RunStopped
from common.progress import Progress

# A game that does not answer a request in this long is taken as hung (a step takes milliseconds,
# a load or reset about a second): the run stops, resumable from its last checkpoint.
REQUEST_TIMEOUT_SECONDS = 300.0


class EnvBatch:
    """With `desc`, a progress line every 30 s while the games run: steps taken of `max_steps`,
    games still going (common/progress.py)."""

    def __init__(self, games: list, desc: str | None = None, max_steps: int = 0):
        self.games = games
        self.observations: list[str] = []
        self.done: list[bool] = []
        self.won: list[bool] = []
        self.progress = Progress(max_steps, desc) if desc else None

    def reset(self) -> list[str]:
        self.observations = _call_all(self.games, "reset", [()] * len(self.games))
        self.done = [False] * len(self.games)
        self.won = [False] * len(self.games)
        return self.observations

    def active(self) -> list[int]:
        """Indices of the games still running."""
        return [i for i, d in enumerate(self.done) if not d]

    def step(self, actions: dict[int, str]) -> dict[int, tuple[str, float, bool, dict]]:
        """Step game i with actions[i] for every running i: {i: (obs, reward, done, info)}."""
        for i in actions:
            if self.done[i]:
                raise ValueError(f"game {i} is finished")
        indices = list(actions)
        answers = _call_all([self.games[i] for i in indices], "step",
                            [(actions[i],) for i in indices])
        results = {}
        for i, (obs, reward, done, info) in zip(indices, answers):
            self.observations[i], self.done[i], self.won[i] = obs, done, bool(info["won"])
            results[i] = (obs, reward, done, info)
        if self.progress is not None:
            self.progress.update(1, playing=len(self.active()))
            if not self.active():
                self.progress.close()
        return results


def _call_all(games: list, method: str, arguments: list[tuple]) -> list:
    """getattr(game, method)(*args) for every game; the remote ones all start before any is
    awaited. Answers come back in the order sent, which is each worker's order too."""
    for game, args in zip(games, arguments):
        if isinstance(game, RemoteGame):
            game.send(method, *args)
    return [game.receive() if isinstance(game, RemoteGame) else getattr(game, method)(*args)
            for game, args in zip(games, arguments)]


# Worker processes --------------------------------------------------------------------------------

def _serve(connection, make_game) -> None:
    """A worker's loop. ("make", id, args) builds a game; (method, id, args) calls it; both are
    answered (id, ok, value, view), view being what the proxy caches; ("close", id) drops a game;
    None ends the loop. An exception is answered with its traceback, not raised."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    games, started = {}, set()
    while True:
        request = connection.recv()
        if request is None:
            return
        method, game_id, args = request
        if method == "close":
            games.pop(game_id, None)
            started.discard(game_id)
            continue
        try:
            if method == "make":
                games[game_id] = make_game(*args)
                value = None
            else:
                value = getattr(games[game_id], method)(*args)
            if method in ("reset", "restore"):
                started.add(game_id)
            connection.send((game_id, True, value, _view(games[game_id], game_id in started)))
        except Exception:  # answered to the caller, which raises it
            connection.send((game_id, False, traceback.format_exc(), None))


def _view(game, started: bool) -> dict:
    """What a proxy answers without a round trip: the attributes and, once the game has been
    reset, the admissible commands and the expert's next command."""
    view = {name: getattr(game, name, None) for name in ("task_type", "task_description",
                                                          "steps", "won", "max_steps")}
    view["admissible_actions"] = game.admissible_actions() if started else []
    view["expert_action"] = game.expert_action() if started and getattr(game, "expert",
                                                                        True) else None
    return view


class WorkerPool:
    """`size` processes that host games made by make_game(*args) (an importable function such as
    envs.make_game). Games of one task made in a row (a group's, an evaluation's draws of a
    game) go to one worker, whose caches make the later copies cheaply; the tasks go in turn.
    Started with "spawn", so a worker never inherits the trainer's threads; close() (also run at
    exit) ends them."""

    def __init__(self, size: int, make_game):
        if size < 1:
            raise ValueError("a WorkerPool needs at least one worker")
        context = multiprocessing.get_context("spawn")
        self.connections, self.processes = [], []
        for _ in range(size):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, make_game), daemon=True)
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)
        self.inbox: list[dict] = [{} for _ in range(size)]  # answers read for another game
        self.labels: dict[int, str] = {}  # game id -> what it plays, for messages
        self._next_id, self._turns = 0, 0
        self._last: tuple[str, int] | None = None  # the last game's task and worker
        atexit.register(self.close)

    def make(self, *args) -> "RemoteGame":
        """A game made in its worker; made asynchronously, awaited at its first call."""
        label = " ".join(str(a) for a in args[:2])  # env and task: its name
        if self._last is not None and self._last[0] == label:
            worker = self._last[1]
        else:
            worker, self._turns = self._turns % len(self.processes), self._turns + 1
        self._last = (label, worker)
        game = RemoteGame(self, worker, self._next_id)
        self.labels[game.game_id] = label
        self._next_id += 1
        game.send("make", *args)
        return game

    def send(self, worker: int, request: tuple) -> None:
        try:
            self.connections[worker].send(request)
        except (BrokenPipeError, OSError) as e:
            raise self._died(worker, f"sending {request[0]}") from e

    def receive(self, worker: int, game_id: int) -> tuple:
        """(ok, value, view): the oldest answer for game_id; answers for the worker's other games
        that arrive first wait in the inbox."""
        inbox = self.inbox[worker]
        while not inbox.get(game_id):
            try:
                if not self.connections[worker].poll(REQUEST_TIMEOUT_SECONDS):
                    self.processes[worker].kill()  # its games are lost with it
                    raise RunStopped(
                        f"env worker {worker} gave no answer in {REQUEST_TIMEOUT_SECONDS:.0f} s "
                        f"(waiting on {self.labels.get(game_id, f'game {game_id}')}): a hung "
                        "game; the run stops here, and its last checkpoint resumes it")
                answer_id, *answer = self.connections[worker].recv()
            except (EOFError, OSError) as e:
                raise self._died(worker, "waiting for an answer") from e
            inbox.setdefault(answer_id, []).append(answer)
        answer = inbox[game_id].pop(0)
        if not inbox[game_id]:
            del inbox[game_id]
        return answer

    def _died(self, worker: int, doing: str) -> RunStopped:
        self.processes[worker].join(timeout=1)
        code = self.processes[worker].exitcode
        return RunStopped(f"env worker {worker} died (exit code {code}) while {doing}; its "
                          "games are lost, so the run stops here, and its last checkpoint "
                          "resumes it")

    def close(self) -> None:
        """Ask every worker to stop, wait up to 5 s in all, then terminate those still running."""
        for connection, process in zip(self.connections, self.processes):
            if process.is_alive():
                try:
                    connection.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 5
        for connection, process in zip(self.connections, self.processes):
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join()
            connection.close()
        self.connections, self.processes = [], []


class RemoteGame:
    """A game in a WorkerPool's process, with the game interface of envs/ (its attributes as of
    the last answer). Where a game in this process would raise, a RemoteGame differs: before
    reset() it has no admissible commands ([]), a game made without its expert answers
    expert_action() with None, and an exception in the worker comes back as a RuntimeError
    carrying the worker's traceback."""

    def __init__(self, pool: WorkerPool, worker: int, game_id: int):
        self.pool, self.worker, self.game_id = pool, worker, game_id
        self._view: dict = {}
        self._waiting = 0  # answers this game has yet to receive

    def send(self, method: str, *args) -> None:
        self.pool.send(self.worker, (method, self.game_id, args))
        self._waiting += 1

    def receive(self):
        """The answer to this game's last request (the answers before it, such as the make's,
        are read and dropped)."""
        value = None
        while self._waiting:
            ok, value, view = self.pool.receive(self.worker, self.game_id)
            self._waiting -= 1
            if not ok:
                raise RuntimeError(f"env worker {self.worker} raised:\n{value}")
            self._view = view
        return value

    def _call(self, method: str, *args):
        self.send(method, *args)
        return self.receive()

    def _cached(self, name: str):
        if self._waiting:
            self.receive()
        return self._view[name]

    def reset(self) -> str:
        return self._call("reset")

    def step(self, command: str):
        return self._call("step", command)

    def snapshot(self):
        return self._call("snapshot")

    def restore(self, snapshot) -> None:
        self._call("restore", snapshot)

    def admissible_actions(self) -> list[str]:
        return list(self._cached("admissible_actions"))

    def expert_action(self) -> str | None:
        return self._cached("expert_action")

    task_type = property(lambda self: self._cached("task_type"))
    task_description = property(lambda self: self._cached("task_description"))
    steps = property(lambda self: self._cached("steps"))
    won = property(lambda self: self._cached("won"))
    max_steps = property(lambda self: self._cached("max_steps"))

    def __del__(self):
        try:
            if self.pool.processes and not self._waiting:
                self.pool.connections[self.worker].send(("close", self.game_id, ()))
        except Exception:  # the pool is already closed (interpreter exit)
            pass
