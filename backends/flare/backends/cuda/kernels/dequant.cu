// dequant.cu: block-quantized weights -> f32, bit-exact (the `dequantize` op, and get_rows of a
// quantized table: an embedding lookup that unpacks only the rows it selects).
//
// One thread per output weight: consecutive threads unpack consecutive weights of one block,
// so a warp reads one or a few blocks (coalesced) and writes 32 consecutive floats. The type
// is the source descriptor's dtype code (quant.cuh), read at run time: the arithmetic per
// weight is a handful of integer operations and one to three single-rounded float ones.
#include "common.cuh"
#include "quant.cuh"

// t0 = w [S0,S1,S2,NB] (blocks; strides in blocks), t1 = out [S0,S1,S2,NB*QK] f32 (contiguous);
// n = out.size
FLARE_KERNEL(flare_dequantize) {
    const i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& w = A.t[0];
    const int qt = w.dtype, qk = flare_qblock_size(qt);
    const i64 row_len = w.shape[3] * qk;
    i64 r = e / row_len;
    const i64 c = e % row_len;
    const i64 c2 = r % w.shape[2];
    r /= w.shape[2];
    const i64 c1 = r % w.shape[1], c0 = r / w.shape[1];
    const i64 blk = w.offset + c0 * w.stride[0] + c1 * w.stride[1] + c2 * w.stride[2] + (c / qk) * w.stride[3];
    const unsigned char* p = (const unsigned char*)w.ptr + blk * flare_qblock_bytes(qt);
    ((float*)A.t[1].ptr)[A.t[1].offset + e] = flare_dq1(qt, p, (int)(c % qk));
}

// t0 = table [1,1,R,NB] (blocks), t1 = idx (4D, any integer dtype), t2 = out (idx.shape +
// (NB*QK,)) f32; n = idx.size * NB * QK. Negative indices count from the end (as get_rows).
FLARE_KERNEL(flare_get_rows_q) {
    const i64 e = flare_thread_index();
    if (e >= A.n) return;
    const TensorDesc& table = A.t[0];
    const int qt = table.dtype, qk = flare_qblock_size(qt);
    const i64 D = table.shape[3] * qk;
    i64 row = flare_load_int(A.t[1], flare_linear(A.t[1], e / D));
    if (row < 0) row += table.shape[2];
    const i64 c = e % D;
    const i64 blk = table.offset + row * table.stride[2] + (c / qk) * table.stride[3];
    const unsigned char* p = (const unsigned char*)table.ptr + blk * flare_qblock_bytes(qt);
    ((float*)A.t[2].ptr)[A.t[2].offset + e] = flare_dq1(qt, p, (int)(c % qk));
}
