"""isoexec_kernels/_triton_util.py: the helpers every Triton launcher shares."""

import torch

from isoexec_kernels._triton_util import int32_segments


def test_int32_segments_start_on_16_byte_boundaries_whatever_the_lengths():
    # packed back to back, the views' offsets would move with the lengths (Triton specialises a
    # pointer on 16-byte alignment, so each new offset class compiled a new kernel variant)
    for lengths in ((1, 1, 3, 3, 3, 3), (5, 5, 2, 2, 2, 2), (0, 4, 7, 1, 0, 9), (8, 8, 4, 4, 4, 4)):
        segs = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)]
        segs[2] = range(len(segs[2]))          # any iterable of ints
        segs[3] = torch.tensor(segs[3] or [], dtype=torch.int64)
        views = int32_segments(segs, torch.device("cpu"))
        base = views[0].untyped_storage().data_ptr()
        assert len(views) == len(segs)
        for seg, view in zip(segs, views):
            assert view.dtype == torch.int32 and view.tolist() == [int(x) for x in seg]
            assert (view.data_ptr() - base) % 16 == 0, (lengths, view.data_ptr() - base)
            assert view.untyped_storage().data_ptr() == base   # one buffer: one host-to-device copy
