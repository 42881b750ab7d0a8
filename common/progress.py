"""Progress output that reads well both on a terminal and in a log file."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """A tqdm bar when stdout is a terminal. Otherwise (a log file, a pipe) plain lines:
    "desc 40/1725 [12s] loss=0.812", one per `interval` seconds and one for the last update.

    update(n, **stats) advances by n and shows `stats` with that update (not one update late)."""

    def __init__(self, total: int, desc: str, initial: int = 0, interval: float = 30.0):
        self.total, self.desc, self.count, self.interval = total, desc, initial, interval
        self.start = self.last_print = time.time()
        self.bar = None
        if sys.stdout.isatty():
            self.bar = tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True,
                            file=sys.stdout)

    def update(self, n: int = 1, **stats) -> None:
        self.count += n
        shown = {k: f"{v:.3g}" if isinstance(v, float) else v for k, v in stats.items()}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(n)
            return
        now = time.time()
        if now - self.last_print >= self.interval or self.count >= self.total:
            self.last_print = now
            fields = " ".join(f"{k}={v}" for k, v in shown.items())
            line = f"{self.desc} {self.count}/{self.total} [{now - self.start:.0f}s] {fields}"
            print(line.rstrip(), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_evaluation(stats: dict, split: str, iteration: int, seconds: float) -> None:
    """[eval test @ iter 8] success 0.620 grounding 0.710 (look 0.46 pick 0.66 ...) [152s],
    printed without breaking a bar."""
    per_type = " ".join(f"{k.rsplit('_', 1)[1]} {v:.2f}"
                        for k, v in stats.items() if "/success_" in k)
    tqdm.write(f"[eval {split} @ iter {iteration}] "
               f"success {stats[f'eval_{split}/success']:.3f} "
               f"grounding {stats[f'eval_{split}/grounding']:.3f} ({per_type}) "
               f"[{seconds:.0f}s]", file=sys.stdout)
    sys.stdout.flush()
