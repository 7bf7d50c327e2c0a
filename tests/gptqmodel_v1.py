"""GPTQModel's v1 export of zero points, written here from its description and independently of cupy_moe's own
conversion (cupy_moe._packing), so that tests of that conversion can fail: the packed real zeros minus a constant
word, borrows crossing fields, for 2, 4 and 8 bits (a real zero of 0 borrows from the field above); field by field
modulo 8 for 3 bits."""
import numpy as np

from cupy_moe import reference

_ONES = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}  # a 1 in every field of a word


def gptqmodel_v1(real, bits):
    """Real zero points [R, N] (ints in [0, 2**bits)) -> the v1 qzeros words [R, N*bits/32] GPTQModel writes."""
    if bits == 3:
        return reference.pack_cols((np.asarray(real) - 1) & 7, bits)
    words = reference.pack_cols(real, bits).view(np.uint32).astype(np.int64)
    return ((words - _ONES[bits]) % 2**32).astype(np.uint32).view(np.int32)
