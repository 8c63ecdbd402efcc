/* Native CPU transport kernels: the twins of quant.reference_quantize_gather and
 * quant.reference_dequantize_scatter (the oracle; quant.torch_dequantize_scatter is the torch path),
 * and of the Triton kernels. At the end, pkv_reader_scan: the planner's one pass over the context (the
 * twin of core/plan.py's numpy reader scan).
 *
 * pkv_restore: decode a run's payload, RoPE-correct its keys, write fp32 destination rows, in one
 * pass per row and head (read codes, decode, rotate, store) instead of the torch reference's
 * several elementwise passes. pkv_quantize: gather a run's rows, compute per-block key and
 * per-group value scales, write codes (4-bit keys and values packed two per byte), in one pass per block.
 *
 * Bit-identical to the references: the same fp32 operations in the same order, compiled with
 * -ffp-contract=off (no fused multiply-adds, which would round differently); fp32 -> fp16 rounds to
 * nearest even, as torch's .half(); the cos/sin tables come from the caller (rope.delta_cos_sin
 * through quant._angle_tables).
 *
 * Knows nothing about Python or torch: native.py compiles it on first use, fills job records with
 * data pointers and calls the two entry points. Work is cut into (job, head, row-chunk) items that
 * POSIX threads take from a shared counter.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { TAG_RAW = 0, TAG_K8V8 = 1, TAG_K8V4 = 2, TAG_K4V4 = 3 };
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

typedef struct {
    int32_t tag;         /* TAG_RAW ("FP16": stored in the source dtype), TAG_K8V8, TAG_K8V4, TAG_K4V4 */
    int32_t src_dtype;   /* TAG_RAW only: DT_F32 / DT_F16 / DT_BF16 */
    int32_t H, D;        /* kv heads, head_dim */
    int32_t block_size;  /* rows per key-scale block */
    int32_t v_group;     /* value group (effective, power of two) */
    int32_t rot;         /* rotated channels (0: keys are not rotated) */
    int32_t interleaved; /* RoPE pairs (2i, 2i+1) instead of (i, i + rot/2) */
    int64_t R;           /* payload rows */
    int64_t M;           /* rows to restore */
    const void *k_data, *v_data;           /* [H, R, D] (4-bit keys or values: [H, R, D/2]) */
    const uint16_t *k_scale, *k_zero;      /* fp16 [H, NB, D] */
    const uint16_t *v_scale, *v_zero;      /* fp16 [H, R, NG] */
    const int64_t *src_rows;               /* [M] payload rows, NULL: 0..M-1 */
    const int64_t *dst_rows;               /* [M] destination rows */
    const int32_t *angle_idx;              /* [M] row of ctab/stab; NULL when rot == 0 */
    const float *ctab, *stab;              /* [U, rot]: C = (cos, cos), S = (-sin, sin) in channel layout */
    float *dst_k, *dst_v;                  /* fp32, innermost stride 1 */
    int64_t dk_sh, dk_sr, dv_sh, dv_sr;    /* element strides: head, row */
    /* Bounds of the buffers above, checked by check_job before anything is read (defence in depth: the
     * caller checks them too, but a job is never trusted to describe its own buffers). */
    int64_t n_dst;                         /* destination rows */
    int64_t n_angles;                      /* rows of ctab / stab */
    int64_t n_k_data, n_v_data;            /* elements (bytes for codes; source-dtype elements for raw runs) */
    int64_t n_k_scale, n_k_zero, n_v_scale, n_v_zero; /* fp16 elements */
    int64_t n_dst_k, n_dst_v;              /* fp32 elements from dst_k / dst_v to the end of their buffers */
} pkv_job;

/* Error codes of pkv_restore / pkv_quantize (argument checks; nothing is read or written on an error). */
enum {
    PKV_E_TAG = -2,    /* unknown tag or source dtype */
    PKV_E_DIMS = -3,   /* heads, head_dim (1..1024, even for 4-bit codes), rotated channels or strides */
    PKV_E_GROUP = -4,  /* block size or value group < 1 */
    PKV_E_SIZE = -5,   /* a buffer is smaller than the job's shape needs (or the shape overflows) */
    PKV_E_SRC = -6,    /* a source row outside the payload (or the gathered rows outside the source) */
    PKV_E_DST = -7,    /* a destination row outside the destination */
    PKV_E_ANGLE = -8,  /* an angle index outside the cos/sin tables */
    PKV_E_NULL = -9,   /* a buffer the job needs is missing */
    PKV_E_ORDER = -10  /* pkv_reader_scan: changed words not increasing, or suffix blocks not increasing runs */
};

#define PKV_MAX_D 1024

/* a * b * c into *out; nonzero on overflow or a negative factor. */
static int mul3(int64_t a, int64_t b, int64_t c, int64_t *out) {
    int64_t t;
    if (a < 0 || b < 0 || c < 0) return 1;
    return __builtin_mul_overflow(a, b, &t) || __builtin_mul_overflow(t, c, out);
}

/* Whether a [H, rows, D] view with element strides (sh, sr) and unit inner stride, from its base pointer,
 * stays inside a buffer of n elements: (H - 1) * sh + (rows - 1) * sr + D <= n (overflow-checked). */
static int view_fits(int64_t H, int64_t rows, int64_t D, int64_t sh, int64_t sr, int64_t n) {
    int64_t a, b, end;
    if (H < 1 || rows < 1) return 1;
    if (sh < 0 || sr < 0 || n < 0) return 0;
    if (__builtin_mul_overflow(H - 1, sh, &a) || __builtin_mul_overflow(rows - 1, sr, &b)) return 0;
    if (__builtin_add_overflow(a, b, &end) || __builtin_add_overflow(end, D, &end)) return 0;
    return end <= n;
}

/* 0 when every index the job will form stays inside its buffers, else a PKV_E_* code. */
static int check_job(const pkv_job *j) {
    if (j->tag < 0 || j->tag > 3 || (j->tag == 0 && (j->src_dtype < 0 || j->src_dtype > 2))) return PKV_E_TAG;
    if (j->H < 1 || j->D < 1 || j->D > PKV_MAX_D || ((j->tag == 2 || j->tag == 3) && j->D % 2)) return PKV_E_DIMS;
    if (j->rot < 0 || j->rot > j->D || j->rot % 2 || j->R < 0 || j->M < 0 || j->n_dst < 0) return PKV_E_DIMS;
    if (j->dk_sh < 0 || j->dk_sr < 0 || j->dv_sh < 0 || j->dv_sr < 0) return PKV_E_DIMS;
    if (j->block_size < 1 || j->v_group < 1) return PKV_E_GROUP;
    if (j->M == 0) return 0;
    if (!j->k_data || !j->v_data || !j->dst_rows || !j->dst_k || !j->dst_v) return PKV_E_NULL;
    if (j->rot && (!j->angle_idx || !j->ctab || !j->stab)) return PKV_E_NULL;
    int64_t need;
    int kdiv = j->tag == 3 ? 2 : 1, vdiv = (j->tag == 2 || j->tag == 3) ? 2 : 1;
    if (mul3(j->H, j->R, j->D / kdiv, &need) || need > j->n_k_data) return PKV_E_SIZE;
    if (mul3(j->H, j->R, j->D / vdiv, &need) || need > j->n_v_data) return PKV_E_SIZE;
    if (j->tag != 0) {
        int64_t nb = j->R / j->block_size + (j->R % j->block_size != 0), ng = j->D / j->v_group + (j->D % j->v_group != 0);
        if (!j->k_scale || !j->k_zero || !j->v_scale || !j->v_zero) return PKV_E_NULL;
        if (mul3(j->H, nb, j->D, &need) || need > j->n_k_scale || need > j->n_k_zero) return PKV_E_SIZE;
        if (mul3(j->H, j->R, ng, &need) || need > j->n_v_scale || need > j->n_v_zero) return PKV_E_SIZE;
    }
    if (j->rot && mul3(j->n_angles, j->rot, 1, &need)) return PKV_E_SIZE;
    /* every destination row the job may write (rows < n_dst) lies inside the fp32 buffers it was given */
    if (!view_fits(j->H, j->n_dst, j->D, j->dk_sh, j->dk_sr, j->n_dst_k)) return PKV_E_SIZE;
    if (!view_fits(j->H, j->n_dst, j->D, j->dv_sh, j->dv_sr, j->n_dst_v)) return PKV_E_SIZE;
    if (!j->src_rows && j->M > j->R) return PKV_E_SRC;
    for (int64_t m = 0; m < j->M; m++) {
        if (j->src_rows && (j->src_rows[m] < 0 || j->src_rows[m] >= j->R)) return PKV_E_SRC;
        if (j->dst_rows[m] < 0 || j->dst_rows[m] >= j->n_dst) return PKV_E_DST;
        if (j->rot && (j->angle_idx[m] < 0 || j->angle_idx[m] >= j->n_angles)) return PKV_E_ANGLE;
    }
    return 0;
}

static inline float h2f(uint16_t h) {
#if defined(__FLT16_MANT_DIG__) && !defined(PKV_NO_FLOAT16)
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: value man * 2^-24, exact in fp32 */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

static inline float bf2f(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t f2h(float f) { /* round to nearest even, as torch's .half() */
#if defined(__FLT16_MANT_DIG__) && !defined(PKV_NO_FLOAT16)
    _Float16 h = (_Float16)f;
    uint16_t out;
    memcpy(&out, &h, 2);
    return out;
#else
    uint32_t x, m, sign, h, rem;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0u)); /* inf, nan */
    if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);                                  /* >= 65520 */
    if (x < 0x38800000u) { /* below 2^-14: a subnormal half, |f| * 2^24 rounded (exact scaling) */
        float a;
        memcpy(&a, &x, 4);
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f));
    }
    m = x & 0x7FFFFFu;
    h = ((((x >> 23) - 112u)) << 10) | (m >> 13);
    rem = m & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
#endif
}

/* n elements of a source in dtype dt, from element offset off, widened to fp32. */
static void load_raw_as(int dt, const void *base, int64_t off, int n, float *out) {
    if (dt == DT_F32) {
        memcpy(out, (const float *)base + off, (size_t)n * sizeof(float));
    } else if (dt == DT_F16) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int c = 0; c < n; c++) out[c] = h2f(s[c]);
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int c = 0; c < n; c++) out[c] = bf2f(s[c]);
    }
}

static void load_raw(const pkv_job *j, const void *base, int64_t off, float *out) {
    load_raw_as(j->src_dtype, base, off, j->D, out);
}

/* Key scales and zeros of (head h, block b) widened to fp32 (once per block, not per row). */
static void key_meta(const pkv_job *j, int h, int64_t b, float *ks, float *kz) {
    int64_t nb = j->R / j->block_size + (j->R % j->block_size != 0), off = ((int64_t)h * nb + b) * j->D;
    for (int c = 0; c < j->D; c++) {
        ks[c] = h2f(j->k_scale[off + c]);
        kz[c] = h2f(j->k_zero[off + c]);
    }
}

/* Keys of payload row r, head h, decoded into x[D]: q * s + z (the product is exact in fp32). */
static void decode_key(const pkv_job *j, int h, int64_t r, const float *ks, const float *kz, float *x) {
    int D = j->D;
    if (j->tag == TAG_RAW) {
        load_raw(j, j->k_data, ((int64_t)h * j->R + r) * D, x);
        return;
    }
    if (j->tag == TAG_K4V4) { /* two codes per byte: channel 2i in the low nibble, 2i + 1 in the high one */
        const uint8_t *q = (const uint8_t *)j->k_data + ((int64_t)h * j->R + r) * (D / 2);
        for (int i = 0; i < D / 2; i++) {
            x[2 * i] = (float)(q[i] & 15) * ks[2 * i] + kz[2 * i];
            x[2 * i + 1] = (float)(q[i] >> 4) * ks[2 * i + 1] + kz[2 * i + 1];
        }
        return;
    }
    const uint8_t *q = (const uint8_t *)j->k_data + ((int64_t)h * j->R + r) * D;
    for (int c = 0; c < D; c++) x[c] = (float)q[c] * ks[c] + kz[c];
}

static void decode_value(const pkv_job *j, int h, int64_t r, float *out) {
    int D = j->D;
    if (j->tag == TAG_RAW) {
        load_raw(j, j->v_data, ((int64_t)h * j->R + r) * D, out);
        return;
    }
    int g = j->v_group, ng = D / g + (D % g != 0);
    const uint16_t *s = j->v_scale + ((int64_t)h * j->R + r) * ng, *z = j->v_zero + ((int64_t)h * j->R + r) * ng;
    if (j->tag == TAG_K8V8) {
        const uint8_t *q = (const uint8_t *)j->v_data + ((int64_t)h * j->R + r) * D;
        for (int k = 0; k < ng; k++) {
            float sf = h2f(s[k]), zf = h2f(z[k]);
            int c1 = (k + 1) * g < D ? (k + 1) * g : D;
            for (int c = k * g; c < c1; c++) out[c] = (float)q[c] * sf + zf;
        }
    } else { /* K8V4, K4V4: two codes per byte, channel 2i in the low nibble, 2i + 1 in the high one */
        const uint8_t *q = (const uint8_t *)j->v_data + ((int64_t)h * j->R + r) * (D / 2);
        uint8_t codes[1024];
        for (int i = 0; i < D / 2; i++) {
            codes[2 * i] = q[i] & 15;
            codes[2 * i + 1] = q[i] >> 4;
        }
        for (int k = 0; k < ng; k++) {
            float sf = h2f(s[k]), zf = h2f(z[k]);
            int c1 = (k + 1) * g < D ? (k + 1) * g : D;
            for (int c = k * g; c < c1; c++) out[c] = (float)codes[c] * sf + zf;
        }
    }
}

/* out = x * C + partner(x) * S over the rotated channels (two roundings then one add, as the
 * torch reference), the rest copied. */
static void rotate(const pkv_job *j, const float *x, const float *C, const float *S, float *out) {
    int rot = j->rot, D = j->D;
    if (j->interleaved) {
        for (int c = 0; c < rot; c += 2) {
            float a = x[c] * C[c], b = x[c + 1] * S[c];
            float e = x[c + 1] * C[c + 1], f = x[c] * S[c + 1];
            out[c] = a + b;
            out[c + 1] = e + f;
        }
    } else {
        int half = rot / 2;
        for (int c = 0; c < half; c++) {
            float a = x[c] * C[c], b = x[c + half] * S[c];
            out[c] = a + b;
        }
        for (int c = half; c < rot; c++) {
            float a = x[c] * C[c], b = x[c - half] * S[c];
            out[c] = a + b;
        }
    }
    for (int c = rot; c < D; c++) out[c] = x[c];
}

static void run_item(const pkv_job *j, int h, int64_t m0, int64_t m1) {
    float x[1024], ks[1024], kz[1024]; /* head_dim <= 1024, checked by the caller */
    int64_t cur = -1;                  /* key block whose scales are in ks, kz */
    for (int64_t m = m0; m < m1; m++) {
        int64_t r = j->src_rows ? j->src_rows[m] : m, d = j->dst_rows[m];
        if (j->tag != TAG_RAW && r / j->block_size != cur) {
            cur = r / j->block_size;
            key_meta(j, h, cur, ks, kz);
        }
        float *ok = j->dst_k + h * j->dk_sh + d * j->dk_sr;
        if (j->rot) {
            decode_key(j, h, r, ks, kz, x);
            int64_t u = j->angle_idx[m];
            rotate(j, x, j->ctab + u * j->rot, j->stab + u * j->rot, ok);
        } else {
            decode_key(j, h, r, ks, kz, ok);
        }
        decode_value(j, h, r, j->dst_v + h * j->dv_sh + d * j->dv_sr);
    }
}

/* ---------------------------------------------------------------- work pool */

typedef struct {
    const char *jobs;
    size_t job_bytes;
    const int64_t *starts; /* [n_jobs + 1] first item of each job */
    int64_t n_items;
    void (*run)(const void *job, int64_t local_item);
    int64_t next; /* shared counter */
} pkv_work;

static void *worker(void *arg) {
    pkv_work *w = (pkv_work *)arg;
    int ji = 0;
    for (;;) {
        int64_t it = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (it >= w->n_items) break;
        while (w->starts[ji + 1] <= it) ji++; /* items are taken in increasing order per thread */
        w->run(w->jobs + (size_t)ji * w->job_bytes, it - w->starts[ji]);
    }
    return NULL;
}

/* Run every item on n_threads threads (the caller's included); returns 0, or -1 when a thread
 * could not be started (the work then finishes on the others, so the result is complete). */
static int run_pool(pkv_work *w, int n_threads) {
    if (n_threads > 64) n_threads = 64;
    if (n_threads > w->n_items) n_threads = (int)w->n_items;
    pthread_t th[64];
    int started = 0, rc = 0;
    for (int t = 1; t < n_threads; t++) {
        if (pthread_create(&th[started], NULL, worker, w) != 0) {
            rc = -1;
            break;
        }
        started++;
    }
    worker(w);
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    return rc;
}

/* ---------------------------------------------------------------- restore */

#define CHUNK_ROWS 256

static void restore_item(const void *job, int64_t local) {
    const pkv_job *j = (const pkv_job *)job;
    int64_t per_head = (j->M + CHUNK_ROWS - 1) / CHUNK_ROWS;
    int64_t m0 = (local % per_head) * CHUNK_ROWS, m1 = m0 + CHUNK_ROWS < j->M ? m0 + CHUNK_ROWS : j->M;
    run_item(j, (int)(local / per_head), m0, m1);
}

/* Restore every job (starts: scratch of n_jobs + 1 entries); returns as run_pool, or a PKV_E_* code with
 * starts[0] set to the index of the first job that failed check_job (then nothing is written). */
int pkv_restore(const pkv_job *jobs, int n_jobs, int n_threads, int64_t *starts) {
    if (!jobs || !starts || n_jobs < 0) return PKV_E_NULL;
    for (int i = 0; i < n_jobs; i++) {
        int rc = check_job(&jobs[i]);
        if (rc) {
            starts[0] = i;
            return rc;
        }
    }
    starts[0] = 0;
    for (int i = 0; i < n_jobs; i++)
        starts[i + 1] = starts[i] + (int64_t)jobs[i].H * ((jobs[i].M + CHUNK_ROWS - 1) / CHUNK_ROWS);
    pkv_work w = {(const char *)jobs, sizeof(pkv_job), starts, starts[n_jobs], restore_item, 0};
    return run_pool(&w, n_threads);
}

/* ---------------------------------------------------------------- quantize */

typedef struct {
    int32_t tag;        /* TAG_RAW, TAG_K8V8, TAG_K8V4, TAG_K4V4 */
    int32_t src_dtype;  /* DT_F32 / DT_F16 / DT_BF16 of k and v */
    int32_t H, D, block_size, v_group;
    int64_t R;                           /* rows gathered */
    const void *k, *v;                   /* sources [H, N, D], innermost stride 1 */
    int64_t k_sh, k_sn, v_sh, v_sn;      /* element strides: head, row */
    const int64_t *rows;                 /* [R] source rows */
    void *k_data, *v_data;               /* [H, R, D] codes (raw: source dtype); 4-bit ones [H, R, D/2] */
    uint16_t *k_scale, *k_zero;          /* fp16 [H, NB, D] */
    uint16_t *v_scale, *v_zero;          /* fp16 [H, R, NG] */
    int64_t N;                           /* source rows (rows[] must lie in [0, N)) */
    /* Bounds of every buffer, checked by check_qjob before anything is read or written: the sources in
     * source-dtype elements from k / v to the end of their buffers, the outputs in their own elements
     * (bytes for codes, source-dtype elements for raw runs, fp16 elements for scales and zeros). */
    int64_t n_k, n_v;
    int64_t n_k_data, n_v_data, n_k_scale, n_k_zero, n_v_scale, n_v_zero;
} pkv_qjob;

/* 0 when the quantize job's shape, gathered rows, sources and outputs are in range, else a PKV_E_* code
 * (nothing is read or written then). */
static int check_qjob(const pkv_qjob *j) {
    if (j->tag < 0 || j->tag > 3 || j->src_dtype < 0 || j->src_dtype > 2) return PKV_E_TAG;
    if (j->H < 1 || j->D < 1 || j->D > PKV_MAX_D || ((j->tag == 2 || j->tag == 3) && j->D % 2)) return PKV_E_DIMS;
    if (j->R < 0 || j->N < 0 || j->k_sh < 0 || j->k_sn < 0 || j->v_sh < 0 || j->v_sn < 0) return PKV_E_DIMS;
    if (j->block_size < 1 || j->v_group < 1) return PKV_E_GROUP;
    if (j->R == 0) return 0;
    if (!j->k || !j->v || !j->rows || !j->k_data || !j->v_data) return PKV_E_NULL;
    if (j->tag != 0 && (!j->k_scale || !j->k_zero || !j->v_scale || !j->v_zero)) return PKV_E_NULL;
    /* sources: every row < N of every head inside the buffers */
    if (!view_fits(j->H, j->N, j->D, j->k_sh, j->k_sn, j->n_k)) return PKV_E_SIZE;
    if (!view_fits(j->H, j->N, j->D, j->v_sh, j->v_sn, j->n_v)) return PKV_E_SIZE;
    /* outputs: the shapes of the format (the sizes the caller allocated, not trusted to match) */
    int64_t need, nb = j->R / j->block_size + (j->R % j->block_size != 0), ng = j->D / j->v_group + (j->D % j->v_group != 0);
    int kdiv = j->tag == 3 ? 2 : 1, vdiv = (j->tag == 2 || j->tag == 3) ? 2 : 1;
    if (mul3(j->H, j->R, j->D / kdiv, &need) || need > j->n_k_data) return PKV_E_SIZE;
    if (mul3(j->H, j->R, j->D / vdiv, &need) || need > j->n_v_data) return PKV_E_SIZE;
    if (j->tag != 0) {
        if (mul3(j->H, nb, j->D, &need) || need > j->n_k_scale || need > j->n_k_zero) return PKV_E_SIZE;
        if (mul3(j->H, j->R, ng, &need) || need > j->n_v_scale || need > j->n_v_zero) return PKV_E_SIZE;
    }
    for (int64_t r = 0; r < j->R; r++)
        if (j->rows[r] < 0 || j->rows[r] >= j->N) return PKV_E_SRC;
    return 0;
}

#define CHUNK_BLOCKS 8

/* fp16 (scale, zero) covering [mn, mx] with the nudges of quant.scale_zero; returns them widened. */
static void scale_zero(float mn, float mx, float qmax, uint16_t *s, uint16_t *z, float *sf, float *zf) {
    const float rel = 0.0009765625f, tiny = 5.9604644775390625e-08f;
    float a = fabsf(mn) * rel, b = mn - a, c = b - tiny;
    *z = f2h(c);
    *zf = h2f(*z);
    float u = mx - *zf, w = u / qmax, y = w * (1.0f + rel), t = y + tiny;
    *s = f2h(t);
    *sf = h2f(*s);
}

static inline int32_t code(float x, float sf, float zf, float qmax) {
    /* clamp(floor(e + 0.5), 0, qmax) of the reference: clamping t = e + 0.5 to [0, qmax] first and truncating
     * gives the same integer (truncation is floor on [0, qmax], and qmax is integral), and, unlike floorf under
     * -fno-fast-math, vectorizes */
    float d = x - zf, e = d / sf, t = e + 0.5f;
    t = t < 0.0f ? 0.0f : (t > qmax ? qmax : t);
    return (int32_t)t; /* integral in [0, qmax]; narrowed to bytes in a loop of its own (vectorizes) */
}

static void quantize_item(const void *job, int64_t local) {
    const pkv_qjob *j = (const pkv_qjob *)job;
    int D = j->D, bs = j->block_size, es = j->src_dtype == DT_F32 ? 4 : 2;
    int64_t nb = j->R / bs + (j->R % bs != 0), per_head = (nb + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
    int h = (int)(local / per_head);
    int64_t b0 = (local % per_head) * CHUNK_BLOCKS, b1 = b0 + CHUNK_BLOCKS < nb ? b0 + CHUNK_BLOCKS : nb;
    int64_t r0 = b0 * bs, r1 = b1 * bs < j->R ? b1 * bs : j->R;
    const char *kb = (const char *)j->k, *vb = (const char *)j->v;
    if (j->tag == TAG_RAW) {
        for (int64_t r = r0; r < r1; r++) {
            int64_t src = j->rows[r], dst = ((int64_t)h * j->R + r) * D;
            memcpy((char *)j->k_data + dst * es, kb + (h * j->k_sh + src * j->k_sn) * es, (size_t)D * es);
            memcpy((char *)j->v_data + dst * es, vb + (h * j->v_sh + src * j->v_sn) * es, (size_t)D * es);
        }
        return;
    }
    float mn[1024], mx[1024], sf[1024], zf[1024], x[1024];
    int32_t iq[1024];
    float kqmax = j->tag == TAG_K4V4 ? 15.0f : 255.0f;
    int64_t blk_rows = bs < j->R ? bs : j->R; /* a block never holds more rows than the run */
    float *blk = (float *)malloc((size_t)blk_rows * D * sizeof(float)); /* one block of keys, widened */
    for (int64_t b = b0; b < b1; b++) { /* keys: per channel over the block's rows */
        int64_t e = (b + 1) * bs < j->R ? (b + 1) * bs : j->R, moff = ((int64_t)h * nb + b) * D;
        int n = (int)(e - b * bs);
        for (int c = 0; c < D; c++) {
            mn[c] = INFINITY;
            mx[c] = -INFINITY;
        }
        for (int i = 0; i < n; i++) {
            float *row = blk ? blk + (size_t)i * D : x;
            load_raw_as(j->src_dtype, j->k, h * j->k_sh + j->rows[b * bs + i] * j->k_sn, D, row);
            for (int c = 0; c < D; c++) {
                mn[c] = row[c] < mn[c] ? row[c] : mn[c];
                mx[c] = row[c] > mx[c] ? row[c] : mx[c];
            }
        }
        for (int c = 0; c < D; c++) scale_zero(mn[c], mx[c], kqmax, j->k_scale + moff + c, j->k_zero + moff + c, sf + c, zf + c);
        for (int i = 0; i < n; i++) {
            float *row = blk ? blk + (size_t)i * D : x;
            if (!blk) load_raw_as(j->src_dtype, j->k, h * j->k_sh + j->rows[b * bs + i] * j->k_sn, D, row);
            for (int c = 0; c < D; c++) iq[c] = code(row[c], sf[c], zf[c], kqmax);
            if (j->tag == TAG_K4V4) { /* channel 2i low nibble, 2i + 1 high */
                uint8_t *q = (uint8_t *)j->k_data + ((int64_t)h * j->R + b * bs + i) * (D / 2);
                for (int c = 0; c < D / 2; c++) q[c] = (uint8_t)(iq[2 * c] | (iq[2 * c + 1] << 4));
            } else {
                uint8_t *q = (uint8_t *)j->k_data + ((int64_t)h * j->R + b * bs + i) * D;
                for (int c = 0; c < D; c++) q[c] = (uint8_t)iq[c];
            }
        }
    }
    free(blk);
    int g = j->v_group, ng = D / g + (D % g != 0);
    float qmax = j->tag == TAG_K8V8 ? 255.0f : 15.0f; /* K8V4, K4V4: 4-bit values */
    for (int64_t r = r0; r < r1; r++) { /* values: per token, groups of g channels */
        int64_t off = h * j->v_sh + j->rows[r] * j->v_sn, moff = ((int64_t)h * j->R + r) * ng;
        load_raw_as(j->src_dtype, j->v, off, D, x);
        for (int k = 0; k < ng; k++) {
            int c0 = k * g, c1 = c0 + g < D ? c0 + g : D;
            float lo = INFINITY, hi = -INFINITY, s, z;
            for (int c = c0; c < c1; c++) {
                lo = x[c] < lo ? x[c] : lo;
                hi = x[c] > hi ? x[c] : hi;
            }
            scale_zero(lo, hi, qmax, j->v_scale + moff + k, j->v_zero + moff + k, &s, &z);
            for (int c = c0; c < c1; c++) iq[c] = code(x[c], s, z, qmax);
        }
        if (j->tag == TAG_K8V8) {
            uint8_t *p = (uint8_t *)j->v_data + ((int64_t)h * j->R + r) * D;
            for (int c = 0; c < D; c++) p[c] = (uint8_t)iq[c];
        } else {
            uint8_t *p = (uint8_t *)j->v_data + ((int64_t)h * j->R + r) * (D / 2);
            for (int i = 0; i < D / 2; i++) p[i] = (uint8_t)(iq[2 * i] | (iq[2 * i + 1] << 4));
        }
    }
}

/* Quantize every job (starts: scratch of n_jobs + 1 entries); returns as pkv_restore. */
int pkv_quantize(const pkv_qjob *jobs, int n_jobs, int n_threads, int64_t *starts) {
    if (!jobs || !starts || n_jobs < 0) return PKV_E_NULL;
    for (int i = 0; i < n_jobs; i++) {
        int rc = check_qjob(&jobs[i]);
        if (rc) {
            starts[0] = i;
            return rc;
        }
    }
    starts[0] = 0;
    for (int i = 0; i < n_jobs; i++) {
        int64_t nb = jobs[i].R / jobs[i].block_size + (jobs[i].R % jobs[i].block_size != 0);
        starts[i + 1] = starts[i] + (int64_t)jobs[i].H * ((nb + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS);
    }
    pkv_work w = {(const char *)jobs, sizeof(pkv_qjob), starts, starts[n_jobs], quantize_item, 0};
    return run_pool(&w, n_threads);
}

/* ---------------------------------------------------------------- 4-bit value residual (precision policy) */

/* quant.value_residual_sq over L layers in one pass: per token, the squared error of the 4-bit per-token
 * value quantizer (groups of v_group channels, the scale/zero/code of pkv_quantize) and the squared norm,
 * summed over layers, heads and channels. Element errors and squares are the reference's fp32 operations;
 * the sums run in double (the reference sums fp32 in torch's order), so results agree to ~1e-7 relative. */
typedef struct {
    const float *const *layers; /* L pointers to contiguous fp32 [H, N, D] values */
    int32_t L, H, D, v_group;
    int64_t N;
    float *err, *ref;           /* [N] outputs */
} pkv_rjob;

#define RESID_ROWS 64

static void residual_item(const void *job, int64_t local) {
    const pkv_rjob *j = (const pkv_rjob *)job;
    int64_t n0 = local * RESID_ROWS, n1 = n0 + RESID_ROWS < j->N ? n0 + RESID_ROWS : j->N;
    double e[RESID_ROWS], r[RESID_ROWS];
    for (int64_t i = 0; i < n1 - n0; i++) e[i] = r[i] = 0.0;
    int D = j->D, g = j->v_group;
    float sqb[PKV_MAX_D], xxb[PKV_MAX_D]; /* one row's squared errors and squares (D <= PKV_MAX_D, checked) */
    int32_t iqb[PKV_MAX_D];
    for (int l = 0; l < j->L; l++) {
        for (int h = 0; h < j->H; h++) {
            const float *base = j->layers[l] + ((int64_t)h * j->N) * D;
            for (int64_t n = n0; n < n1; n++) {
                const float *x = base + n * D;
                double ed = 0.0, rd = 0.0;
                for (int c0 = 0; c0 < D; c0 += g) {
                    int c1 = c0 + g < D ? c0 + g : D;
                    float mn = x[c0], mx = x[c0];
                    for (int c = c0 + 1; c < c1; c++) {
                        mn = x[c] < mn ? x[c] : mn;
                        mx = x[c] > mx ? x[c] : mx;
                    }
                    uint16_t s16, z16;
                    float sf, zf;
                    scale_zero(mn, mx, 15.0f, &s16, &z16, &sf, &zf);
                    for (int c = c0; c < c1; c++) iqb[c] = code(x[c], sf, zf, 15.0f); /* fp32 work: vectorizes */
                    for (int c = c0; c < c1; c++) {
                        float d = x[c] - ((float)iqb[c] * sf + zf);
                        sqb[c] = d * d;
                        xxb[c] = x[c] * x[c];
                    }
                    for (int c = c0; c < c1; c++) { /* the double sums, in channel order as before */
                        ed += (double)sqb[c];
                        rd += (double)xxb[c];
                    }
                }
                e[n - n0] += ed;
                r[n - n0] += rd;
            }
        }
    }
    for (int64_t n = n0; n < n1; n++) {
        j->err[n] = (float)e[n - n0];
        j->ref[n] = (float)r[n - n0];
    }
}

/* Residual sums of one job (starts: scratch of 2 entries); 0, -1 (a thread failed to start, result
 * complete) or a PKV_E_* code for bad arguments. */
int pkv_value_residual(const pkv_rjob *job, int n_threads, int64_t *starts) {
    if (!job || !starts || !job->layers || !job->err || !job->ref) return PKV_E_NULL;
    if (job->L < 1 || job->H < 1 || job->D < 1 || job->D > PKV_MAX_D || job->N < 0) return PKV_E_DIMS;
    if (job->v_group < 1) return PKV_E_GROUP;
    for (int l = 0; l < job->L; l++)
        if (!job->layers[l]) return PKV_E_NULL;
    starts[0] = 0;
    starts[1] = (job->N + RESID_ROWS - 1) / RESID_ROWS;
    if (starts[1] == 0) return 0;
    pkv_work w = {(const char *)job, sizeof(pkv_rjob), starts, starts[1], residual_item, 0};
    return run_pool(&w, n_threads);
}

/* The occurrence scan of the lexical reader signal (patchkv_agent.core.plan.lexical_reader_scores; its
 * numpy twin is plan._reader_scan_numpy, and the two give equal arrays). Over the new context's
 * word ids words[0..n), for the m changed words (changed[], strictly increasing):
 *   df[t]   = the number of distinct ctx_block-token blocks (cut from position 0) holding the first token
 *             of an occurrence of changed[t] (a position p is a word's first token unless words[p-1] ==
 *             words[p]);
 *   pairs   = the distinct (suffix block, t) with changed[t] at some position of the block, ordered by
 *             block, then t; suffix block b covers positions [starts[b], ends[b]) (non-empty, increasing,
 *             disjoint, within [0, n)).
 * One pass over the context: a 64 Ki-bit map of the changed words' low 16 bits screens each position, and
 * only screened positions are binary-searched. scratch: 2 * m int64; pair_blk / pair_tok hold cap entries
 * (n suffices). Returns 0 with *n_pairs set, or a PKV_E_* code for bad arguments (outputs undefined then). */
static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void sort_i64(int64_t *a, int64_t k) {
    if (k > 32) {
        qsort(a, (size_t)k, sizeof(int64_t), cmp_i64);
        return;
    }
    for (int64_t i = 1; i < k; i++) { /* insertion sort: a block holds a few distinct changed words */
        int64_t v = a[i], j = i - 1;
        while (j >= 0 && a[j] > v) {
            a[j + 1] = a[j];
            j--;
        }
        a[j + 1] = v;
    }
}

int pkv_reader_scan(const int64_t *words, int64_t n, const int64_t *changed, int64_t m, int64_t ctx_block,
                    const int64_t *starts, const int64_t *ends, int64_t nb, int64_t *df, int64_t *pair_blk,
                    int64_t *pair_tok, int64_t cap, int64_t *scratch, int64_t *n_pairs) {
    if (n < 0 || m < 0 || nb < 0 || cap < 0) return PKV_E_DIMS;
    if (ctx_block < 1) return PKV_E_GROUP;
    if (!n_pairs || (n && !words) || (m && (!changed || !df || !scratch)) || (nb && (!starts || !ends)) ||
        (cap && (!pair_blk || !pair_tok)))
        return PKV_E_NULL;
    for (int64_t t = 1; t < m; t++)
        if (changed[t] <= changed[t - 1]) return PKV_E_ORDER;
    for (int64_t b = 0; b < nb; b++)
        if (starts[b] < 0 || ends[b] <= starts[b] || ends[b] > n || (b && starts[b] < ends[b - 1]))
            return PKV_E_ORDER;
    uint64_t bits[1024];
    memset(bits, 0, sizeof bits);
    int64_t *last_ctx = scratch, *last_blk = scratch + m;
    for (int64_t t = 0; t < m; t++) {
        uint64_t lo = (uint64_t)changed[t] & 0xFFFFu;
        bits[lo >> 6] |= (uint64_t)1 << (lo & 63);
        df[t] = 0;
        last_ctx[t] = -1;
        last_blk[t] = -1;
    }
    int64_t out = 0, seg = 0, cur = -1, bi = 0;
    for (int64_t p = 0; p < n && m; p++) {
        int64_t w = words[p];
        uint64_t lo = (uint64_t)w & 0xFFFFu;
        if (!((bits[lo >> 6] >> (lo & 63)) & 1)) continue;
        int64_t a = 0, z = m; /* first t with changed[t] >= w */
        while (a < z) {
            int64_t mid = a + (z - a) / 2;
            if (changed[mid] < w) a = mid + 1; else z = mid;
        }
        if (a == m || changed[a] != w) continue;
        if (p == 0 || words[p - 1] != w) { /* the word's first token: its context block counts once */
            int64_t cb = p / ctx_block;
            if (last_ctx[a] != cb) {
                last_ctx[a] = cb;
                df[a]++;
            }
        }
        while (bi < nb && ends[bi] <= p) bi++;
        if (bi < nb && starts[bi] <= p && last_blk[a] != bi) {
            if (bi != cur) { /* a new block: the previous block's words in increasing order */
                sort_i64(pair_tok + seg, out - seg);
                seg = out;
                cur = bi;
            }
            if (out >= cap) return PKV_E_SIZE;
            last_blk[a] = bi;
            pair_blk[out] = bi;
            pair_tok[out] = a;
            out++;
        }
    }
    sort_i64(pair_tok + seg, out - seg);
    *n_pairs = out;
    return 0;
}
