"""Unit tests of leanimg.delta: the encoder's choice of encoding, decoding and applying entries
of each encoding (built here byte by byte from spec §7, not by the encoder), the fast paths
(small_index_list, parse_index_lists) against the checking decoder, and the rule each malformed
entry breaks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from leanimg import delta
from leanimg.errors import FormatError
from leanimg.format import DELTA_ENTRY, DeltaEncoding
from leanimg.rules import IMPLEMENTATIONS
from leanimg.structures import reserved_problems

PS = 4096
WORDS = PS // 8
IL, BM, RU = DeltaEncoding.INDEX_LIST, DeltaEncoding.BITMAP, DeltaEncoding.RUNS


def head(encoding: int, num_words: int, reserved: int = 0) -> bytes:
    return DELTA_ENTRY.pack(encoding=encoding, reserved=reserved, num_words=num_words)


def values_of(values) -> bytes:
    return np.asarray(values, dtype=np.uint64).astype("<u8").tobytes()


def runs_of(positions) -> list[tuple[int, int]]:
    runs = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def runs_body(runs) -> bytes:
    return struct.pack("<H", len(runs)) + b"".join(struct.pack("<HH", s, n) for s, n in runs)


def entry(encoding: int, positions, values, *, page_size: int = PS) -> bytes:
    """A delta entry as spec §7.3-7.5 lays it out."""
    if encoding == IL:
        where = struct.pack(f"<{len(positions)}H", *positions)
    elif encoding == BM:
        bits = np.zeros(page_size // 8, bool)
        bits[list(positions)] = True
        where = np.packbits(bits, bitorder="little").tobytes()
    else:
        where = runs_body(runs_of(positions))
    return head(encoding, len(positions)) + where + values_of(values)


def page(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 1 << 63, WORDS, dtype=np.uint64).astype("<u8").tobytes()


def changed(old: bytes, positions) -> bytes:
    words = np.frombuffer(old, "<u8").copy()
    words[list(positions)] ^= np.uint64(0xFFFF_0000_FFFF_0001)
    return words.tobytes()


# --- encode -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "positions,encoding",
    [
        ([7], IL),
        (list(range(0, WORDS, 2)), BM),  # 256 scattered words
        (list(range(100, 200)), RU),  # one run of 100
        (list(range(0, 40)) + list(range(300, 340)), RU),
    ],
)
def test_encode_picks_the_shortest_encoding(positions, encoding):
    old = page(1)
    got = delta.encode(old, changed(old, positions))
    sizes = delta.encoded_sizes(len(positions), len(runs_of(positions)), PS)
    assert got[0] == encoding and len(got) == sizes[encoding] == min(sizes.values())


def test_encode_on_a_tie_gives_an_entry_of_the_shortest_length():
    old = page(2)
    got = delta.encode(old, changed(old, range(10, 13)))  # 3 words in one run: INDEX_LIST and RUNS 34 bytes
    sizes = delta.encoded_sizes(3, 1, PS)
    assert sizes[IL] == sizes[RU] == 34
    assert len(got) == 34 and got[0] in (IL, RU)


def test_encode_equal_pages_is_none():
    old = page(3)
    assert delta.encode(old, old) is None


def test_encode_none_when_no_entry_is_smaller_than_a_page():
    old = page(4)
    longest = delta.encode(old, changed(old, range(510)))  # RUNS: 6 + 4 + 8 * 510 = 4090 bytes
    assert longest[0] == RU and len(longest) == 4090
    assert delta.encode(old, changed(old, range(511))) is None  # 4098 bytes: LI-DLT-004
    assert delta.encode(old, changed(old, range(WORDS))) is None


# --- decode and apply ----------------------------------------------------------------------------------
@st.composite
def entries(draw, encodings=(IL, BM, RU), max_words=60):
    encoding = draw(st.sampled_from(encodings))
    positions = sorted(draw(st.lists(st.integers(0, WORDS - 1), min_size=1, max_size=max_words, unique=True)))
    values = draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(positions), max_size=len(positions)))
    return encoding, positions, values


@given(spec=entries(), seed=st.integers(0, 2**16))
def test_decode_positions_and_apply_round_trip(spec, seed):
    encoding, positions, values = spec
    e = entry(encoding, positions, values)
    got_positions, got_values = delta.decode_positions(e, PS)
    assert got_positions.tolist() == positions and got_values.tolist() == values
    parent = page(seed)
    words = np.frombuffer(parent, "<u8").copy()
    words[positions] = np.asarray(values, np.uint64)
    assert delta.apply(e, parent) == words.tobytes()


@given(spec=entries(max_words=40))
def test_small_index_list_agrees_with_decode_positions(spec):
    encoding, positions, values = spec
    e = entry(encoding, positions, values)
    fast = delta.small_index_list(e, PS)
    if encoding != IL or len(positions) > delta.FAST_WORDS:
        assert fast is None
        return
    want_positions, want_values = delta.decode_positions(e, PS)
    assert fast == (tuple(want_positions.tolist()), want_values.tobytes())


# --- malformed entries ------------------------------------------------------------------------------------
MALFORMED = {
    "shorter than its head": (b"\x01\x00", "LI-DLT-002"),
    "a whole page": (head(IL, 409) + bytes(PS - 4), "LI-DLT-004"),
    "reserved byte set": (head(IL, 1, reserved=1) + struct.pack("<H", 3) + values_of([1]), "LI-REC-008"),
    "encoding 0": (head(0, 1) + struct.pack("<H", 3) + values_of([1]), "LI-DLT-002"),
    "encoding 4": (head(4, 1) + struct.pack("<H", 3) + values_of([1]), "LI-DLT-002"),
    "no words": (head(IL, 0), "LI-DLT-002"),
    "index list too short": (head(IL, 2) + struct.pack("<H", 3) + values_of([1]), "LI-DLT-002"),
    "index list descending": (head(IL, 2) + struct.pack("<2H", 5, 3) + values_of([1, 2]), "LI-DLT-003"),
    "index list repeated": (head(IL, 2) + struct.pack("<2H", 3, 3) + values_of([1, 2]), "LI-DLT-003"),
    "index past the page": (head(IL, 1) + struct.pack("<H", WORDS) + values_of([1]), "LI-DLT-003"),
    "bitmap popcount": (head(BM, 2) + entry(BM, [4], [1])[4:] + values_of([2]), "LI-DLT-002"),
    "bitmap too short": (entry(BM, [4], [1])[:-1], "LI-DLT-002"),
    "runs without a count": (head(RU, 1), "LI-DLT-002"),
    "runs none": (head(RU, 1) + runs_body([]) + values_of([1]), "LI-DLT-003"),
    "run of length 0": (head(RU, 1) + runs_body([(3, 0)]) + values_of([1]), "LI-DLT-003"),
    "runs total": (head(RU, 1) + runs_body([(3, 2)]) + values_of([1]), "LI-DLT-002"),
    "runs touching": (head(RU, 3) + runs_body([(0, 2), (2, 1)]) + values_of([1, 2, 3]), "LI-DLT-003"),
    "runs overlapping": (head(RU, 4) + runs_body([(0, 3), (1, 1)]) + values_of([1, 2, 3, 4]), "LI-DLT-003"),
    "runs descending": (head(RU, 2) + runs_body([(9, 1), (3, 1)]) + values_of([1, 2]), "LI-DLT-003"),
    "run past the page": (head(RU, 3) + runs_body([(WORDS - 2, 3)]) + values_of([1, 2, 3]), "LI-DLT-003"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_entry_breaks_its_rule(name):
    e, rule = MALFORMED[name]
    where = dict(offset=0x1234, structure="record[9].delta_frame.entries[4]")
    for decode in (lambda: delta.decode_positions(e, PS, **where), lambda: delta.apply(e, page(5), **where)):
        with pytest.raises(FormatError) as info:
            decode()
        assert info.value.rule == rule, info.value
        assert info.value.offset == 0x1234 and info.value.structure.startswith(where["structure"])
    assert IMPLEMENTATIONS[rule] is (delta.decode_positions if rule.startswith("LI-DLT") else reserved_problems)


def test_reserved_byte_is_named_in_the_path():
    e, _ = MALFORMED["reserved byte set"]
    with pytest.raises(FormatError) as info:
        delta.decode_positions(e, PS, structure="record[9].delta_frame.entries[4]")
    assert (info.value.rule, info.value.structure) == ("LI-REC-008", "record[9].delta_frame.entries[4].reserved")


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_small_index_list_leaves_malformed_entries_to_the_checking_decoder(name):
    assert delta.small_index_list(MALFORMED[name][0], PS) is None


@pytest.mark.parametrize("parser", ["native", "numpy"])
def test_parse_index_lists_takes_exactly_the_sound_index_lists(parser, monkeypatch):
    if parser == "numpy":
        monkeypatch.setattr(delta, "_native", None)
    sound = [
        entry(IL, [3], [30]),
        entry(IL, list(range(0, 400, 10)), range(40)),
        entry(BM, [1, 2], [5, 6]),
        entry(RU, [7, 8, 9], [1, 2, 3]),
        entry(IL, [WORDS - 1], [2**64 - 1]),
    ]
    malformed = [MALFORMED[name][0] for name in sorted(MALFORMED)]
    content = sound + malformed
    offsets = np.concatenate(([0], np.cumsum([len(e) for e in content])))
    simple, start, count, positions, values = delta.parse_index_lists(b"".join(content), offsets, PS)
    assert simple.tolist() == [True, True, False, False, True] + [False] * len(malformed)
    for k in np.flatnonzero(simple).tolist():
        want_positions, want_values = delta.decode_positions(content[k], PS)
        taken = slice(int(start[k]), int(start[k]) + int(count[k]))
        assert positions[taken].tolist() == want_positions.tolist()
        assert values[taken].tolist() == want_values.tolist()
