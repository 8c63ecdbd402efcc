/* Fused CPU restore: decode a run's payload, RoPE-correct its keys, write fp32 destination rows.
 *
 * The native twin of quant.reference_dequantize_scatter (and of the Triton kernel): one pass per
 * row and head (read codes, decode, rotate, store) instead of the torch reference's several
 * elementwise passes. Bit-identical to the reference: the same fp32 operations in the same order,
 * compiled with -ffp-contract=off (no fused multiply-adds, which would round differently), and the
 * cos/sin tables come from the caller (rope.delta_cos_sin through quant._angle_tables).
 *
 * Knows nothing about Python or torch: native.py compiles it on first use, fills pkv_job records
 * with data pointers and calls pkv_restore. Work is cut into (job, head, row-chunk) items that
 * POSIX threads take from a shared counter.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { TAG_RAW = 0, TAG_K8V8 = 1, TAG_K8V4 = 2 };
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

typedef struct {
    int32_t tag;         /* TAG_RAW ("FP16": stored in the source dtype), TAG_K8V8, TAG_K8V4 */
    int32_t src_dtype;   /* TAG_RAW only: DT_F32 / DT_F16 / DT_BF16 */
    int32_t H, D;        /* kv heads, head_dim */
    int32_t block_size;  /* rows per key-scale block */
    int32_t v_group;     /* value group (effective, power of two) */
    int32_t rot;         /* rotated channels (0: keys are not rotated) */
    int32_t interleaved; /* RoPE pairs (2i, 2i+1) instead of (i, i + rot/2) */
    int64_t R;           /* payload rows */
    int64_t M;           /* rows to restore */
    const void *k_data, *v_data;           /* [H, R, D] (K8V4 values: [H, R, D/2]) */
    const uint16_t *k_scale, *k_zero;      /* fp16 [H, NB, D] */
    const uint16_t *v_scale, *v_zero;      /* fp16 [H, R, NG] */
    const int64_t *src_rows;               /* [M] payload rows, NULL: 0..M-1 */
    const int64_t *dst_rows;               /* [M] destination rows */
    const int32_t *angle_idx;              /* [M] row of ctab/stab; NULL when rot == 0 */
    const float *ctab, *stab;              /* [U, rot]: C = (cos, cos), S = (-sin, sin) in channel layout */
    float *dst_k, *dst_v;                  /* fp32, innermost stride 1 */
    int64_t dk_sh, dk_sr, dv_sh, dv_sr;    /* element strides: head, row */
} pkv_job;

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

static void load_raw(const pkv_job *j, const void *base, int64_t off, float *out) {
    int D = j->D;
    if (j->src_dtype == DT_F32) {
        memcpy(out, (const float *)base + off, (size_t)D * sizeof(float));
    } else if (j->src_dtype == DT_F16) {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int c = 0; c < D; c++) out[c] = h2f(s[c]);
    } else {
        const uint16_t *s = (const uint16_t *)base + off;
        for (int c = 0; c < D; c++) out[c] = bf2f(s[c]);
    }
}

/* Key scales and zeros of (head h, block b) widened to fp32 (once per block, not per row). */
static void key_meta(const pkv_job *j, int h, int64_t b, float *ks, float *kz) {
    int64_t nb = (j->R + j->block_size - 1) / j->block_size, off = ((int64_t)h * nb + b) * j->D;
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
    const uint8_t *q = (const uint8_t *)j->k_data + ((int64_t)h * j->R + r) * D;
    for (int c = 0; c < D; c++) x[c] = (float)q[c] * ks[c] + kz[c];
}

static void decode_value(const pkv_job *j, int h, int64_t r, float *out) {
    int D = j->D;
    if (j->tag == TAG_RAW) {
        load_raw(j, j->v_data, ((int64_t)h * j->R + r) * D, out);
        return;
    }
    int g = j->v_group, ng = (D + g - 1) / g;
    const uint16_t *s = j->v_scale + ((int64_t)h * j->R + r) * ng, *z = j->v_zero + ((int64_t)h * j->R + r) * ng;
    if (j->tag == TAG_K8V8) {
        const uint8_t *q = (const uint8_t *)j->v_data + ((int64_t)h * j->R + r) * D;
        for (int k = 0; k < ng; k++) {
            float sf = h2f(s[k]), zf = h2f(z[k]);
            int c1 = (k + 1) * g < D ? (k + 1) * g : D;
            for (int c = k * g; c < c1; c++) out[c] = (float)q[c] * sf + zf;
        }
    } else { /* two codes per byte: channel 2i in the low nibble, 2i + 1 in the high one */
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

#define CHUNK_ROWS 256

typedef struct {
    const pkv_job *jobs;
    int n_jobs;
    const int64_t *starts; /* [n_jobs + 1] first item of each job */
    int64_t n_items;
    int64_t next; /* shared counter */
} pkv_work;

static void *worker(void *arg) {
    pkv_work *w = (pkv_work *)arg;
    int ji = 0;
    for (;;) {
        int64_t it = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (it >= w->n_items) break;
        while (w->starts[ji + 1] <= it) ji++; /* items are taken in increasing order per thread */
        const pkv_job *j = &w->jobs[ji];
        int64_t local = it - w->starts[ji], per_head = (j->M + CHUNK_ROWS - 1) / CHUNK_ROWS;
        int h = (int)(local / per_head);
        int64_t m0 = (local % per_head) * CHUNK_ROWS, m1 = m0 + CHUNK_ROWS < j->M ? m0 + CHUNK_ROWS : j->M;
        run_item(j, h, m0, m1);
    }
    return NULL;
}

/* Restore every job; returns 0, or -1 when a thread could not be started (work then finishes on
 * the calling thread, so the result is complete either way). */
int pkv_restore(const pkv_job *jobs, int n_jobs, int n_threads, int64_t *starts) {
    starts[0] = 0;
    for (int i = 0; i < n_jobs; i++)
        starts[i + 1] = starts[i] + (int64_t)jobs[i].H * ((jobs[i].M + CHUNK_ROWS - 1) / CHUNK_ROWS);
    pkv_work w = {jobs, n_jobs, starts, starts[n_jobs], 0};
    if (n_threads > 64) n_threads = 64;
    if (n_threads > w.n_items) n_threads = (int)w.n_items;
    pthread_t th[64];
    int started = 0, rc = 0;
    for (int t = 1; t < n_threads; t++) {
        if (pthread_create(&th[started], NULL, worker, &w) != 0) {
            rc = -1;
            break;
        }
        started++;
    }
    worker(&w);
    for (int t = 0; t < started; t++) pthread_join(th[t], NULL);
    return rc;
}
