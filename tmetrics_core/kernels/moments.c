/* The CPU kernels of tmetrics (bound in moments.py): one read of each tensor for every
 * elementwise statistic (tm_moments), row softmax sums of small tables (tm_row_softmax), and
 * the update snapshot's copy of the parameters in one call (tm_copy).
 *
 * For each contiguous tensor x (float32 or bfloat16), optionally minus a second tensor y of the
 * same dtype and length, the pass writes five doubles:
 *   [0] sum of squares   (each square and the sum in float64: no overflow below 1e154,
 *                          no lost digits on long tensors)
 *   [1] sum              (float64)
 *   [2] largest element  (NaN skipped: the comparison is false for NaN; -inf when empty)
 *   [3] smallest element (NaN skipped; +inf when empty)
 *   [4] elements equal to zero (-0.0 included)
 * A NaN anywhere makes [0] NaN, an infinity makes [0] +inf: the caller derives non-finite
 * facts from [0] and counts exactly only then. Asked for three rows, the pass over a pair
 * (x, y) writes those of x - y, x and y (an optimizer step's update, the parameter after it and
 * the parameter before it): no slower than reading x - y and x again, and y's row comes free.
 * Asked for sums of squares only (every statistic of the call reads [0] alone: L2 norms, RMS,
 * update ratios), the pass keeps that one accumulator and writes NaN to [1]..[4]; [0] has the
 * same bits as in a full pass (same lanes, same order). On a pass bound by arithmetic (a few
 * hundred KiB of activations, the three rows of a pair) that halves the time.
 *
 * Work is cut into pieces of at most PIECE elements, merged per tensor in piece order (the
 * result does not depend on the thread count). `threads` > 1 runs the pieces on that many
 * OpenMP threads: built with -fopenmp where torch's own runtime is libgomp, the kernel shares
 * torch's thread pool, whose workers are still spinning after the model's last kernel (a pool
 * of its own would fight them for the cores). Without -fopenmp the pragmas are ignored and one
 * thread reads everything. Accumulators are kept in LANES independent lanes so the compiler
 * vectorizes the loop without reassociating floating point (no -ffast-math: NaN must still
 * propagate).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define PIECE (1 << 16)
#define FIELDS 5

enum { TM_FLOAT32 = 0, TM_BFLOAT16 = 1 };

static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }

static inline float load_bf16(const void *p, int64_t i) {
    uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The accumulators of one moments row in LANES independent lanes: float max/min (NaN never
 * wins a comparison), float64 sums. */
typedef struct {
    double sq[LANES], sum[LANES];
    float hi[LANES], lo[LANES];
    int32_t zeros[LANES];
} lanes_t;

#define INLINE static inline __attribute__((always_inline))

INLINE void lanes_start(lanes_t *a) {
    for (int j = 0; j < LANES; j++) {
        a->sq[j] = 0;
        a->sum[j] = 0;
        a->hi[j] = -__builtin_inff();
        a->lo[j] = __builtin_inff();
        a->zeros[j] = 0;
    }
}

INLINE void lanes_take(lanes_t *a, int j, float v) {
    double d = (double)v;
    a->sq[j] += d * d;
    a->sum[j] += d;
    a->hi[j] = v > a->hi[j] ? v : a->hi[j];
    a->lo[j] = v < a->lo[j] ? v : a->lo[j];
    a->zeros[j] += v == 0.0f;
}

INLINE void lanes_write(const lanes_t *a, double *out) {
    double total_sq = 0, total = 0, top = -__builtin_inf(), bottom = __builtin_inf();
    int64_t total_zeros = 0;
    for (int j = 0; j < LANES; j++) {
        total_sq += a->sq[j];
        total += a->sum[j];
        top = a->hi[j] > top ? a->hi[j] : top;
        bottom = a->lo[j] < bottom ? a->lo[j] : bottom;
        total_zeros += a->zeros[j];
    }
    out[0] = total_sq;
    out[1] = total;
    out[2] = top;
    out[3] = bottom;
    out[4] = (double)total_zeros;
}

/* The sum-of-squares accumulator alone, in the same lanes as lanes_t's (same bits). */
typedef struct {
    double sq[LANES];
} squares_t;

INLINE void squares_start(squares_t *a) {
    for (int j = 0; j < LANES; j++) a->sq[j] = 0;
}

INLINE void squares_take(squares_t *a, int j, float v) {
    double d = (double)v;
    a->sq[j] += d * d;
}

INLINE void squares_write(const squares_t *a, double *out) {
    double total_sq = 0;
    for (int j = 0; j < LANES; j++) total_sq += a->sq[j];
    out[0] = total_sq;
    for (int f = 1; f < FIELDS; f++) out[f] = __builtin_nan("");
}

/* A pass over elements [begin, end) writing ROWS rows of FIELDS to out with the accumulators
 * ACC (lanes: every field; squares: [0] only); TAKE(FEED, LOAD, r, j, i) feeds element i to the
 * rows' lane j. */
#define DEFINE_PASS(NAME, ACC, LOAD, ROWS, TAKE)                                              \
    static void NAME(const void *x, const void *y, int64_t begin, int64_t end, double *out) { \
        (void)y; /* read only by the passes of differences */                                 \
        ACC##_t r[ROWS];                                                                      \
        for (int k = 0; k < ROWS; k++) ACC##_start(&r[k]);                                    \
        int64_t i = begin;                                                                    \
        for (; i + LANES <= end; i += LANES)                                                  \
            for (int j = 0; j < LANES; j++) TAKE(ACC##_take, LOAD, r, j, i + j);              \
        for (int j = 0; i < end; i++, j++) TAKE(ACC##_take, LOAD, r, j, i);                   \
        for (int k = 0; k < ROWS; k++) ACC##_write(&r[k], out + FIELDS * k);                  \
    }

/* x */
#define PLAIN(FEED, LOAD, r, j, i) FEED(&r[0], j, LOAD(x, i))
/* x - y (bfloat16 widened first: the difference is not rounded to bfloat16) */
#define DIFFERENCE(FEED, LOAD, r, j, i) FEED(&r[0], j, LOAD(x, i) - LOAD(y, i))
/* x - y, x and y from one read of each */
#define PARTS(FEED, LOAD, r, j, i)              \
    do {                                        \
        float u = LOAD(x, i), w = LOAD(y, i);   \
        FEED(&r[0], j, u - w);                  \
        FEED(&r[1], j, u);                      \
        FEED(&r[2], j, w);                      \
    } while (0)

typedef void (*pass_t)(const void *, const void *, int64_t, int64_t, double *);

/* The six passes (float32 and bfloat16; plain, difference, parts) of the accumulators ACC. */
#define DEFINE_PASSES(ACC)                                      \
    DEFINE_PASS(ACC##_f32, ACC, load_f32, 1, PLAIN)             \
    DEFINE_PASS(ACC##_f32_diff, ACC, load_f32, 1, DIFFERENCE)   \
    DEFINE_PASS(ACC##_f32_parts, ACC, load_f32, 3, PARTS)       \
    DEFINE_PASS(ACC##_bf16, ACC, load_bf16, 1, PLAIN)           \
    DEFINE_PASS(ACC##_bf16_diff, ACC, load_bf16, 1, DIFFERENCE) \
    DEFINE_PASS(ACC##_bf16_parts, ACC, load_bf16, 3, PARTS)

DEFINE_PASSES(lanes)
DEFINE_PASSES(squares)

/* PASSES[sums of squares only][bfloat16][plain, difference, parts] */
static const pass_t PASSES[2][2][3] = {
    {{lanes_f32, lanes_f32_diff, lanes_f32_parts}, {lanes_bf16, lanes_bf16_diff, lanes_bf16_parts}},
    {{squares_f32, squares_f32_diff, squares_f32_parts}, {squares_bf16, squares_bf16_diff, squares_bf16_parts}},
};

typedef struct {
    int64_t tensor, begin, end;
} piece_t;

typedef struct {
    const uint64_t *xs, *ys;
    const int32_t *dtypes;
    const piece_t *pieces;
    int64_t count;
    int32_t rows;    /* moments rows per tensor: 1, or 3 (x - y, x, y) */
    int32_t squares; /* sums of squares only */
    double *partial;
} job_t;

static void run_piece(const job_t *job, int64_t k) {
    const piece_t *p = &job->pieces[k];
    const void *x = (const void *)(uintptr_t)job->xs[p->tensor];
    const void *y = (const void *)(uintptr_t)job->ys[p->tensor];
    double *out = job->partial + FIELDS * job->rows * k;
    int kind = job->rows == 3 ? 2 : y ? 1 : 0;
    PASSES[job->squares][job->dtypes[p->tensor] == TM_BFLOAT16][kind](x, y, p->begin, p->end, out);
}

/* Moments of `count` tensors: xs[i] (and ys[i] when non-zero) point at ns[i] elements of
 * dtypes[i]. With rows = 1, out receives count x FIELDS doubles: the moments of x, or of x - y
 * where ys[i] is non-zero. With rows = 3 (every ys[i] non-zero), count x 3 x FIELDS: the
 * moments of x - y, of x and of y, from one read of each. With squares non-zero only [0] of
 * each row is computed, [1]..[4] are NaN. Returns 0, -1 when memory ran out, -2 (reading
 * nothing) when a non-empty tensor has a null pointer, -3 for rows other than 1 or 3. */
int tm_moments(int64_t count, const uint64_t *xs, const uint64_t *ys, const int64_t *ns,
               const int32_t *dtypes, int32_t threads, int32_t rows, int32_t squares, double *out) {
    if (rows != 1 && rows != 3) return -3;
    for (int64_t i = 0; i < count; i++)
        if (ns[i] > 0 && (!xs[i] || (rows == 3 && !ys[i]))) return -2;
    int64_t npieces = 0;
    for (int64_t i = 0; i < count; i++) npieces += ns[i] > 0 ? (ns[i] + PIECE - 1) / PIECE : 1;
    piece_t *pieces = malloc(sizeof(piece_t) * (size_t)npieces);
    double *partial = malloc(sizeof(double) * FIELDS * rows * (size_t)npieces);
    if (!pieces || !partial) {
        free(pieces);
        free(partial);
        return -1;
    }
    int64_t k = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t begin = 0;
        do {
            int64_t end = ns[i] - begin > PIECE ? begin + PIECE : ns[i];
            pieces[k++] = (piece_t){i, begin, end};
            begin = end;
        } while (begin < ns[i]);
    }
    job_t job = {xs, ys, dtypes, pieces, npieces, rows, squares != 0, partial};
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && npieces > 1)
    for (int64_t q = 0; q < npieces; q++) run_piece(&job, q);
    for (int64_t i = 0; i < count * rows; i++) {
        double *o = out + FIELDS * i;
        o[0] = 0;
        o[1] = 0;
        o[2] = -__builtin_inf();
        o[3] = __builtin_inf();
        o[4] = 0;
    }
    for (k = 0; k < npieces; k++)
        for (int32_t r = 0; r < rows; r++) {
            double *o = out + FIELDS * (rows * pieces[k].tensor + r), *p = partial + FIELDS * (rows * k + r);
            o[0] += p[0];
            o[1] += p[1];
            o[2] = p[2] > o[2] ? p[2] : o[2];
            o[3] = p[3] < o[3] ? p[3] : o[3];
            o[4] += p[4];
        }
    if (squares)
        for (int64_t i = 0; i < count * rows; i++)
            for (int f = 1; f < FIELDS; f++) out[FIELDS * i + f] = __builtin_nan("");
    free(pieces);
    free(partial);
    return 0;
}

/* entr(p) = -p log p as torch.special.entr: 0 at 0, -inf below 0, NaN for NaN. */
static double entr(double p) {
    if (p > 0) return -p * log(p);
    if (p == 0) return 0.0;
    return p != p ? p : -__builtin_inf();
}

static double load(const void *x, int32_t dtype, int64_t i) {
    return dtype == TM_BFLOAT16 ? (double)load_bf16(x, i) : (double)load_f32(x, i);
}

/* Entropy H and log-partition lse of one row of logits z, as softmax.py's torch path computes
 * them (m = max z, H = log s - t / s, lse = m + log s with s = sum e^(z-m), t = sum e^(z-m)(z-m)):
 * a NaN, a +inf or a row of -inf gives NaN; -inf entries weigh nothing. */
static void logit_row(const void *x, int32_t dtype, int64_t base, int64_t cols, double *h, double *lse) {
    double m = -__builtin_inf();
    int nan = 0;
    for (int64_t j = 0; j < cols; j++) {
        double z = load(x, dtype, base + j);
        if (z != z) nan = 1;
        else if (z > m) m = z;
    }
    if (nan || isinf(m)) {
        *h = *lse = __builtin_nan("");
        return;
    }
    double s = 0, t = 0;
    for (int64_t j = 0; j < cols; j++) {
        double shifted = load(x, dtype, base + j) - m, e = exp(shifted);
        s += e;
        if (e > 0) t += e * shifted;
    }
    *h = log(s) - t / s;
    *lse = m + log(s);
}

/* Rows given as probabilities: with S = sum p, H = log S + sum entr(p) / S, lse = log S. */
static void probability_row(const void *x, int32_t dtype, int64_t base, int64_t cols, double *h, double *lse) {
    double total = 0, ent = 0;
    for (int64_t j = 0; j < cols; j++) {
        double p = load(x, dtype, base + j);
        total += p;
        ent += entr(p);
    }
    *lse = log(total);
    *h = *lse + ent / total;
}

/* Row softmax sums of `count` contiguous [rows[i], cols[i]] tables xs[i] (float32 or bfloat16;
 * probabilities[i] non-zero: the rows are probabilities, else logits), in float64: out receives
 * count x 6 doubles [0, sum H, sum H / log classes[i], sum lse, sum lse^2, rows] (the finished
 * vector of softmax.py; NaN normalizer for one class; zeros without rows), the tables spread
 * over `threads` threads. Returns 0, or -2 (reading nothing) when a non-empty table has a null
 * pointer. */
int tm_row_softmax(int64_t count, const uint64_t *xs, const int64_t *rows, const int64_t *cols,
                   const int64_t *classes, const int32_t *dtypes, const int32_t *probabilities, int32_t threads,
                   double *out) {
    for (int64_t i = 0; i < count; i++)
        if (rows[i] > 0 && cols[i] > 0 && !xs[i]) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
    for (int64_t i = 0; i < count; i++) {
        const void *x = (const void *)(uintptr_t)xs[i];
        double *o = out + 6 * i, sum_h = 0, sum_lse = 0, sum_lse_sq = 0;
        for (int64_t r = 0; r < rows[i]; r++) {
            double h, lse;
            (probabilities[i] ? probability_row : logit_row)(x, dtypes[i], r * cols[i], cols[i], &h, &lse);
            sum_h += h;
            sum_lse += lse;
            sum_lse_sq += lse * lse;
        }
        double norm = classes[i] > 1 ? log((double)classes[i]) : __builtin_nan("");
        o[0] = 0;
        o[1] = sum_h;
        o[2] = rows[i] ? sum_h / norm : 0;
        o[3] = sum_lse;
        o[4] = sum_lse_sq;
        o[5] = (double)rows[i];
    }
    return 0;
}

/* Lays out count copies in one buffer (an update snapshot of the parameters): copy i takes
 * nbytes[i] = numels[i] elements of dtype codes[i] and starts offsets[i] bytes in, a multiple of
 * 64 after the previous copy's end. Returns the bytes the buffer needs. */
int64_t tm_layout(int64_t count, const int64_t *numels, const int32_t *codes, int64_t *nbytes, uint64_t *offsets) {
    int64_t at = 0;
    for (int64_t i = 0; i < count; i++) {
        nbytes[i] = numels[i] * (codes[i] == TM_BFLOAT16 ? 2 : 4);
        offsets[i] = (uint64_t)at;
        at += (nbytes[i] + 63) & ~(int64_t)63;
    }
    return at;
}

/* Copies count byte ranges: nbytes[i] bytes from srcs[i] to base + dsts[i] (tm_layout's
 * offsets, turned into the addresses in place), in pieces of PIECE floats' bytes over `threads`
 * threads: one call instead of a torch kernel launch per tensor. Returns 0, -1 when memory ran
 * out, -2 (copying nothing) when a range with bytes has a null pointer. */
int tm_copy(int64_t count, const uint64_t *srcs, uint64_t *dsts, const int64_t *nbytes, uint64_t base,
            int32_t threads) {
    for (int64_t i = 0; i < count; i++) dsts[i] += base;
    const int64_t step = (int64_t)PIECE * (int64_t)sizeof(float);
    int64_t npieces = 0;
    for (int64_t i = 0; i < count; i++) {
        if (nbytes[i] > 0 && (!srcs[i] || !dsts[i])) return -2;
        npieces += (nbytes[i] + step - 1) / step;
    }
    piece_t *pieces = malloc(sizeof(piece_t) * (size_t)(npieces ? npieces : 1));
    if (!pieces) return -1;
    int64_t k = 0;
    for (int64_t i = 0; i < count; i++)
        for (int64_t begin = 0; begin < nbytes[i]; begin += step)
            pieces[k++] = (piece_t){i, begin, nbytes[i] - begin > step ? begin + step : nbytes[i]};
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && npieces > 1)
    for (int64_t q = 0; q < npieces; q++) {
        const piece_t *p = &pieces[q];
        memcpy((char *)(uintptr_t)dsts[p->tensor] + p->begin, (const char *)(uintptr_t)srcs[p->tensor] + p->begin,
               (size_t)(p->end - p->begin));
    }
    free(pieces);
    return 0;
}
