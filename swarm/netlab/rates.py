"""Link rates as a user writes them (`100mbit`, `20mbit`, `1gbit`) and how tc's token bucket is sized
for one.

Units are tc's, in bits per second with decimal prefixes: bit, kbit, mbit, gbit. tc reads `mbps`
as megaBYTES per second; that spelling is refused here rather than guessed, so `--link 20mbps`
cannot silently mean 160 Mbit/s.

The rate counts what the link carries: Ethernet frames with their IP and TCP headers. A bulk TCP
transfer's payload is about 95% of it (1448 bytes of data in each 1514-byte frame).
"""

from __future__ import annotations

import dataclasses
import re
from decimal import Decimal

UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
MIN_BITS_PER_S = 100 * 10**3  # below this one 1500-byte frame takes over 0.1 s: no swarm runs there
MAX_BITS_PER_S = 100 * 10**9

# tbf's bucket: `burst` bytes may leave at once; the queue holds `limit` bytes beyond that
BURST_S = 0.010  # 10 ms of traffic: tolerates a late timer on a busy machine, and is <1% of a 2 s transfer
MIN_BURST_BYTES = 32 * 1024  # a few full frames, and a 64 KB GSO packet in two pieces
QUEUE_S = 0.050  # a full queue delays by 50 ms, as a home router's buffer does; TCP fills the link

_RATE = re.compile(r"(\d+(?:\.\d+)?)([a-z]+)")


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Rate:
    """A link's rate in bits per second, in each direction."""

    bits_per_s: int

    def __post_init__(self) -> None:
        if not MIN_BITS_PER_S <= self.bits_per_s <= MAX_BITS_PER_S:
            raise ValueError(f"a link rate must be between {Rate._text(MIN_BITS_PER_S)} and "
                             f"{Rate._text(MAX_BITS_PER_S)}, got {Rate._text(self.bits_per_s)}")  # fmt: skip

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8

    @property
    def tc(self) -> str:
        """The rate as tc's argument, exact."""
        return f"{self.bits_per_s}bit"

    @property
    def burst_bytes(self) -> int:
        return max(MIN_BURST_BYTES, round(self.bytes_per_s * BURST_S))

    @property
    def limit_bytes(self) -> int:
        return self.burst_bytes + round(self.bytes_per_s * QUEUE_S)

    def __str__(self) -> str:
        return self._text(self.bits_per_s)

    @staticmethod
    def _text(bits: int) -> str:
        """The largest unit that writes it whole: 1gbit, 1500kbit, 50mbit."""
        for unit, factor in sorted(UNITS.items(), key=lambda item: -item[1]):
            if bits % factor == 0:
                return f"{bits // factor}{unit}"
        raise AssertionError("unreachable: 'bit' divides every integer")


def parse_rate(text: str) -> Rate:
    """`20mbit` -> Rate(20_000_000). ValueError, with the accepted forms, for anything else."""
    match = _RATE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in UNITS:
        if match is not None and match.group(2).endswith("bps"):
            raise ValueError(f"{text!r}: write bits per second, e.g. '20mbit' (tc reads 'mbps' as megabytes/s)")
        raise ValueError(f"{text!r} is not a rate: write a number and a unit, e.g. 500kbit, 20mbit, 1gbit")
    bits = Decimal(match.group(1)) * UNITS[match.group(2)]  # exact: 1.1mbit is 1100000 bits
    if bits != int(bits):
        raise ValueError(f"{text!r} is not a whole number of bits per second")
    return Rate(int(bits))


def parse_rates(text: str) -> tuple[Rate, ...]:
    """`100mbit,100mbit,20mbit` -> one Rate each, in order."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise ValueError(f"{text!r}: give rates separated by commas, e.g. 100mbit,100mbit,20mbit")
    return tuple(parse_rate(part) for part in parts)
