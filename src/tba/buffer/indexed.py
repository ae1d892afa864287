"""A set of prompt ids with O(1) add, remove and uniform random choice (the replay buffer's pools)."""

from __future__ import annotations

import random


class IndexedSet:
    """A set with O(1) add, discard and uniform choice (list + position map, swap-remove)."""

    def __init__(self, items: list[str] | None = None) -> None:
        self.items: list[str] = list(items or [])
        self._pos = {item: i for i, item in enumerate(self.items)}

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: str) -> None:
        if item not in self._pos:
            self._pos[item] = len(self.items)
            self.items.append(item)

    def discard(self, item: str) -> None:
        i = self._pos.pop(item, None)
        if i is None:
            return
        last = self.items.pop()
        if i < len(self.items):  # move the last item into the hole
            self.items[i] = last
            self._pos[last] = i

    def set(self, item: str, present: bool) -> None:
        if present:
            self.add(item)
        else:
            self.discard(item)

    def choice(self, rng: random.Random) -> str:
        return self.items[rng.randrange(len(self.items))]
