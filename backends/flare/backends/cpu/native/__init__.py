"""The native CPU executor: a split runs as one call into C (kernels.c).

`load()` builds the kernels once (cffi API mode, cached by source hash),
installs the BLAS NumPy uses, and returns the `Native` handle, or None with
`REASON` saying why the NumPy path is used instead (FLARE_CPU_NATIVE=0, no
cffi, no compiler, no BLAS found).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .blas import Blas, find_blas

_CDEF = """
typedef struct {
    int32_t kind; int32_t flags; void *out; void *src[4];
    int64_t ne[4]; int64_t os[4]; int64_t ss[4][4]; int64_t ip[8]; double fp[4]; void *scratch;
} flare_cmd;
void flare_set_blas(void *sgemm, void *sgemv, int ilp64);
int64_t flare_run(const flare_cmd *cmds, int64_t n, int32_t *err);
int32_t flare_kind_count(void);
int32_t flare_packed_isa(int32_t want);
int32_t flare_conv1d_isa(int32_t want);
int32_t flare_conv1d_wino(void);
int64_t flare_conv1d_wino_scratch(int64_t B, int64_t Ci, int64_t Co, int64_t K, int64_t d, int64_t Lo,
                                  int64_t slots);
int32_t flare_conv1d_wino_tables(int32_t K, float *out);
int32_t flare_invariant_isa(int32_t want);
int32_t flare_quant_isa(int32_t want);
int64_t flare_qact_row_bytes(int32_t type, int64_t k);
void flare_qact_quantize_row(int32_t type, const float *x, void *xq, int64_t k);
void flare_qmatmul_rows(int32_t type, const void *w, int64_t w_row_bytes, int64_t k, const void *xq,
                        int64_t xq_row_bytes, int64_t m, float *out, int64_t ldo, int64_t r0, int64_t r1);
void flare_dequantize_row(int32_t type, const void *w, float *y, int64_t k);
typedef struct flare_pool flare_pool;
flare_pool *flare_pool_new(int threads);
void flare_pool_free(flare_pool *pool);
int flare_pool_threads(const flare_pool *pool);
int64_t flare_run_pool(flare_pool *pool, const flare_cmd *cmds, int64_t n, int32_t *err);
int64_t flare_pool_regions(const flare_pool *pool);
typedef void (*flare_task)(void *ctx, int64_t begin, int64_t end);
void flare_pool_for(flare_pool *pool, int64_t n, int64_t grain, flare_task task, void *ctx);
int64_t flare_split_count(const flare_cmd *cmds, int64_t n, int32_t nth);
int32_t flare_cmd_mode(const flare_cmd *c, int32_t nth, int64_t *work);
int32_t flare_stage_experts(const int32_t *ids, int64_t n_tok, int64_t k, const uint8_t *valid, int32_t *out,
                            int32_t *table, int32_t *expert_in, double *uses, double *last, int64_t *state,
                            int32_t n_experts, int32_t slots, int32_t age_every, int32_t n_tensors,
                            uint8_t *const *dst, const uint8_t *const *src, const int64_t *row_bytes,
                            uint8_t *mark, int32_t *record, int64_t *info);
"""


@dataclass
class Native:
    lib: Any
    ffi: Any
    blas: Blas


PACKED_ISAS = ("plain C", "AVX2", "AVX-512")  # flare_packed_isa's return values
QUANT_ISAS = ("?", "plain C", "AVX2", "AVX-512 VNNI")  # flare_quant_isa's (quant.h)
_NATIVE: Native | None = None
_TRIED = False
REASON = "not loaded yet"


def enabled_by_env() -> bool:
    return os.environ.get("FLARE_CPU_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> Native | None:
    """The native executor, or None (see REASON). Built and loaded once per process."""
    global _NATIVE, _TRIED, REASON
    if not enabled_by_env():
        REASON = "disabled by FLARE_CPU_NATIVE=0"
        return None
    if _TRIED:
        return _NATIVE
    _TRIED = True
    try:
        from .build import build
        from ..lowering import KINDS
        here = Path(__file__).parent
        # staging.h: the expert-staging step (staging.c), declared for the cffi wrappers
        module = build("_flare_native", (here / "kernels.c").read_text() + '\n#include "staging.h"\n', _CDEF,
                       sources=(here / "pool.c", here / "quant.c", here / "staging.c"), include_dirs=(here,),
                       libraries=("m", "pthread"), announce="building the CPU kernels")
        blas = find_blas()
        if blas is None:
            REASON = "no OpenBLAS with cblas_sgemm found in this process or numpy.libs"
            return None
        if module.lib.flare_kind_count() != len(KINDS):
            REASON = "kernels.c and commands.py disagree on the kernel ids"
            return None
        module.lib.flare_set_blas(module.ffi.cast("void *", blas.sgemm), module.ffi.cast("void *", blas.sgemv),
                                  int(blas.ilp64))
        _NATIVE = Native(module.lib, module.ffi, blas)
        isa = PACKED_ISAS[module.lib.flare_packed_isa(-1)]
        qisa = QUANT_ISAS[module.lib.flare_quant_isa(0)]
        REASON = (f"C kernels (cffi, packed-weight microkernel {isa}, quantized dots {qisa}), "
                  f"BLAS {os.path.basename(blas.path)}")
    except ImportError as exc:
        REASON = f"cffi is not installed ({exc})"
    except Exception as exc:  # no compiler, read-only cache...: the NumPy path still works
        REASON = f"could not build the C kernels: {type(exc).__name__}: {exc}"
    return _NATIVE
