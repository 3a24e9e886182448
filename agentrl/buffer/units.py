"""In-memory bookkeeping of the buffer: pending entries, servable units, waiting groups, leases.

An ``Entry`` keeps a pending sample as its encoded PUT payload (arrival time + sample record), so the
buffer holds about 8 bytes per token and serves the wire format without re-encoding.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

ARRIVAL = struct.Struct("<d")


@dataclass(slots=True)
class Entry:
    sample_id: str
    episode_id: str
    group_id: str
    min_version: int
    arrival: float
    payload: bytes  # the PUT payload: arrival time + sample record

    @property
    def record(self) -> memoryview:
        return memoryview(self.payload)[ARRIVAL.size :]


@dataclass
class Unit:
    """What is served whole: one group, or one sample when groups are off."""

    key: str
    ids: list[str]
    episodes: set[str]
    partial: bool = False


@dataclass
class Group:
    """A group still collecting its G episodes."""

    group_id: str
    first_arrival: float
    ids: list[str] = field(default_factory=list)
    episodes: set[str] = field(default_factory=set)


@dataclass
class Lease:
    batch_id: str
    units: list[Unit]
    learner_version: int
    deadline: float
    staleness: Counter[int]

    @property
    def ids(self) -> list[str]:
        return [i for u in self.units for i in u.ids]


class Bounded(OrderedDict[str, Any]):
    """An insertion-ordered map that forgets its oldest keys beyond ``cap``."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def add(self, key: str, value: Any = None) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)
