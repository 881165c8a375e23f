"""The one CODEBOOK_SLICE encoder (``slice_parts``) and its inverse (``slice_fields``)."""

from __future__ import annotations

import numpy as np
import pytest

from mapl_swarm.wire import decode, encode
from mapl_swarm.wire.codebook import SliceMalformed, slice_fields, slice_message, slice_parts


def test_slice_parts_passes_arrays_through_in_wire_order():
    codes, index = object(), object()  # any array type: peers pass torch tensors
    p = slice_parts(stream="act", version=7, start=0, full=False, codes=codes, index=index)
    assert p.cver == 7
    assert p.meta == {"stream": "act", "start": 0}  # no "full" key on a partial slice
    assert list(p.tensors) == ["codes", "index"]
    assert p.tensors["codes"] is codes and p.tensors["index"] is index
    full = slice_parts(stream="grad", version=3, start=0, full=True, codes=codes)
    assert full.meta == {"stream": "grad", "start": 0, "full": True}
    assert list(full.tensors) == ["codes"]


@pytest.mark.parametrize("full,start,index", [
    (False, 4, None),
    (True, 0, None),
    (False, 0, np.array([[[1, 5, 9], [0, 2, 15]], [[3, 4, 7], [8, 11, 12]]], dtype="u1")),
])
def test_slice_fields_reads_what_slice_message_writes(full, start, index):
    n = 16 if full else 3
    codes = np.arange(2 * 2 * n * 2, dtype=np.float32).reshape(2, 2, n, 2) / 8
    msg = slice_message(run_id="r", src=0, dst=1, stream="act", version=9, start=start, full=full,
                        codes=codes, step=5, micro=1, seq=3, pver=2, index=index)
    back = decode(encode(msg))
    assert (back.step, back.micro, back.seq, back.pver) == (5, 1, 3, 2)
    f = slice_fields(back)
    assert (f.stream, f.version, f.start, f.full) == ("act", 9, start, full)
    np.testing.assert_array_equal(f.codes, codes)
    if index is None:
        assert f.index is None
    else:
        np.testing.assert_array_equal(f.index, index)
        assert f.index_dtype == "uint8"


def test_slice_fields_refuses_a_slice_without_meta():
    msg = slice_message(run_id="r", src=0, dst=1, stream="act", version=1, start=0, full=False,
                        codes=np.zeros((1, 1, 1, 1), np.float32))
    msg.meta = {}
    with pytest.raises(SliceMalformed):
        slice_fields(decode(encode(msg)))
