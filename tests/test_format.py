"""The format module agrees with the byte tables of spec/format.md."""

import re
from pathlib import Path

import numpy as np
import pytest

from leanimg import format as fmt

SPEC = (Path(__file__).resolve().parents[1] / "spec" / "format.md").read_text()

# structure -> (struct, size the spec's table gives)
SIZES = {
    "header": (fmt.HEADER_STRUCT, 104),
    "record header": (fmt.RECORD_HEADER_STRUCT, 16),
    "REGION": (fmt.REGION_STRUCT, 32),
    "DISK": (fmt.DISK_STRUCT, 48),
    "SOURCE_STATE": (fmt.SOURCE_STATE_STRUCT, 16),
    "PAGE_FRAME": (fmt.PAGE_FRAME_STRUCT, 16),
    "DELTA_FRAME": (fmt.DELTA_FRAME_STRUCT, 16),
    "DISK_REFS": (fmt.DISK_REFS_STRUCT, 16),
    "disk reference": (fmt.DISK_REF_STRUCT, 16),
    "PAGE_MAP": (fmt.PAGE_MAP_STRUCT, 8),
    "extent": (fmt.EXTENT_STRUCT, 24),
    "DIGESTS": (fmt.DIGESTS_STRUCT, 24),
    "INDEX": (fmt.INDEX_STRUCT, 8),
    "index entry": (fmt.INDEX_ENTRY_STRUCT, 32),
    "footer": (fmt.FOOTER_STRUCT, 48),
    "delta entry": (fmt.DELTA_ENTRY_STRUCT, 4),
}


@pytest.mark.parametrize("name", SIZES)
def test_struct_size_matches_spec(name):
    st, size = SIZES[name]
    assert st.size == size
    assert st.format.startswith("<"), "every structure is explicitly little-endian"


@pytest.mark.parametrize("dtype,st", [(fmt.EXTENT_DTYPE, fmt.EXTENT_STRUCT),
                                      (fmt.DISK_REF_DTYPE, fmt.DISK_REF_STRUCT),
                                      (fmt.INDEX_ENTRY_DTYPE, fmt.INDEX_ENTRY_STRUCT)])
def test_numpy_dtypes_match_structs(dtype, st):
    assert np.dtype(dtype).itemsize == st.size


def test_magics_and_constants_appear_in_spec():
    assert fmt.HEADER_MAGIC.hex(" ").upper() in SPEC.upper()
    assert fmt.FOOTER_MAGIC.hex(" ").upper() in SPEC.upper()
    for record_type in fmt.RecordType:
        assert f"0x{int(record_type):08X}".lower() in SPEC.lower() or \
            f"0x{int(record_type):x}" in SPEC.lower(), record_type.name


def test_spec_tables_give_the_header_length():
    assert re.search(r"header_length.*104", SPEC)
