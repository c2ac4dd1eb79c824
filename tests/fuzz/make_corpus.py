"""Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/seed-*).

Seeds are well-formed inputs, and a few near misses, that get the fuzzers past
the first checks at once: a member's hello with the secret frame_fuzz.cc uses,
then every frame type; records as the library encodes them. Run it again when
a format changes:  python tests/fuzz/make_corpus.py
The other files there are inputs that long runs found to reach new code,
merged in with libFuzzer's -merge=1 (see scripts/fuzz.sh); they are kept.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECRET = b"0123456789abcdef0123456789abcdef"  # frame_fuzz.cc's kSecret
HEADER = 128  # kSegmentHeaderBytes
HELLO, WRITE, SIGNAL, HEARTBEAT, SIGNAL_MAX, BYE = 1, 2, 3, 4, 5, 6


def frame(kind: int, bell: int, offset: int, arg: int) -> bytes:
    return struct.pack("<IIQQ", kind, bell, offset, arg)


def hello(
    rank: int = 1, inc: int = 0, secret: bytes = SECRET, to: tuple[int, int] = (0, 0)
) -> bytes:
    """A hello from slot `rank`, incarnation `inc`, for the receiver `to`
    (slot, incarnation; frame_fuzz.cc's receiver is (0, 0))."""
    return frame(HELLO, 32, inc | to[1] << 32, rank | to[0] << 32) + secret


def write(offset: int, payload: bytes) -> bytes:
    return frame(WRITE, 0, offset, len(payload)) + payload


def frame_seeds() -> dict[str, bytes]:
    member = hello()
    return {
        "write_signal": b"\x01"
        + member
        + write(HEADER + 64, b"x" * 100)
        + frame(SIGNAL, 0, HEADER, 1),
        "every_type": b"\x03"
        + member
        + frame(HEARTBEAT, 0, 0, 0)
        + write(4000, b"abcdefgh" * 12)
        + frame(SIGNAL_MAX, 2, HEADER + 8, 7)
        + frame(SIGNAL, 3, 4088, 9)
        + write(4096, b"")
        + frame(BYE, 0, 0, 0),
        "not_accepted": b"\x00" + member + write(HEADER, b"y" * 16),
        "wrong_secret": b"\x01" + hello(secret=b"f" * 32) + write(HEADER, b"z" * 8),
        "before_hello": b"\x01" + write(HEADER, b"q" * 8) + member,
        "second_hello": b"\x01" + member + hello(2),
        "for_another": b"\x01" + hello(to=(1, 0)) + write(HEADER, b"a" * 8),
        "for_a_restart": b"\x01" + hello(to=(0, 1)) + write(HEADER, b"r" * 8),
        "outside": b"\x01" + member + frame(WRITE, 0, 4090, 16) + b"o" * 16,
        "split_payload": b"\x05" + member + write(HEADER, bytes(range(256)) * 4),
    }


def view(epoch: int, seq: int, slots: list[tuple[int, int, int]]) -> str:
    return " ".join([str(epoch), str(seq), str(len(slots))] + [f"{a} {i} {s}" for a, i, s in slots])


def record_seeds() -> dict[str, bytes]:
    v = view(3, 120, [(1, 0, 3), (0, 2, 3), (1, 1, 3), (1, 0, 0)])
    reports = ["0 121 120 1 0 0", "2 121 119 0 0 2", "3 121 120 1 1 0"]
    address = (
        "\n".join(
            [
                "2",
                "1",
                "boot|net:[4026531840]|pid:[4026531836]",
                "4242",
                "17",
                "1048576",
                "10.0.0.2",
                "40123",
            ]
        )
        + "\n"
    )
    return {
        "view": b"\x00" + v.encode(),
        "view_one": b"\x00" + view(0, 0, [(1, 0, 0)]).encode(),
        "report": b"\x01" + reports[0].encode(),
        "decision": b"\x02" + (v + "\n" + "\n".join(reports) + "\n").encode(),
        "address": b"\x03" + address.encode(),
        "fields": b"\x04-17 4294967295 1000 word",
        "fields_short": b"\x04" + b"1 2",
    }


def main() -> None:
    for target, seeds in (("frame_fuzz", frame_seeds()), ("record_fuzz", record_seeds())):
        out = HERE / "corpus" / target
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("seed-*"):
            old.unlink()
        for name, data in seeds.items():
            digest = hashlib.sha1(data).hexdigest()[:12]
            (out / f"seed-{name}-{digest}").write_bytes(data)
        print(f"{target}: {len(seeds)} seeds in {out}")


if __name__ == "__main__":
    main()
