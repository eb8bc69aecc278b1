/* The planner's hot loops in C (ds_resilience/ir/native.py loads them with ctypes): the list
 * scheduler, the timed replay, the validator's rules 1-5 and the memory peaks.
 *
 * The replay: the same execution model as ds_resilience/ir/replay.py with buffered sends (gloo's),
 * for the step modes whose OPT_STEP is a local compute or a collective; it gives what the planner
 * reads (every iteration's end, the makespan, a deadlock), not the spans or the messages.
 *
 * Every worker's program is a slice [off[w], off[w+1]) of the op arrays, run `repeat` times back to
 * back; the per-op outputs (ends, arrivals) are laid out per worker at roff[w] + copy * size + i.
 * Ops:
 *   OP_COMPUTE     dur = duration
 *   OP_SEND        a = peer, b = link id (the directed pair), dur = time on the link
 *   OP_RECV        a = sender, b = the matched send's index in the sender's program (the same
 *                  copy's send: the k-th receive of a message key matches its k-th send)
 *   OP_COLLECTIVE  a = group, dur = this member's duration; starts when its last member arrives
 * Times come from the same double operations in the same order as the Python loop, so they are
 * equal bit for bit. No allocation failure goes unreported: the function returns -1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OP_COMPUTE = 0, OP_SEND = 1, OP_RECV = 2, OP_COLLECTIVE = 3 };

typedef int64_t i64;

/* Returns 0, or -1 when out of memory. pcs[w] ends below size * repeat for every worker that
 * could not finish (a deadlock). iter_ends[k] (k < n_iter) is the latest end of the k-th is_opt op
 * over all workers; *last_arrival the latest arrival of any message (0 without one). */
int dsr_replay(int n, const i64 *off, const i64 *roff, const int32_t *code, const int32_t *a,
               const i64 *b, const double *dur, const uint8_t *is_opt, int repeat, double latency,
               int n_links, int n_groups, const i64 *goff, const int32_t *gmem, double *ends,
               double *arrival, i64 *pcs, double *iter_ends, int n_iter, double *last_arrival)
{
    double *clock = calloc((size_t)n, sizeof(double));
    double *link_free = calloc((size_t)(n_links > 0 ? n_links : 1), sizeof(double));
    int *queue = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    uint8_t *queued = calloc((size_t)n, 1);
    uint8_t *registered = calloc((size_t)n, 1);
    int *woken = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    uint8_t *is_woken = calloc((size_t)n, 1);
    i64 *g_count = calloc((size_t)(n_groups > 0 ? n_groups : 1), sizeof(i64));
    double *g_max = calloc((size_t)(n_groups > 0 ? n_groups : 1), sizeof(double));
    if (!clock || !link_free || !queue || !queued || !registered || !woken || !is_woken || !g_count || !g_max) {
        free(clock); free(link_free); free(queue); free(queued); free(registered); free(woken);
        free(is_woken); free(g_count); free(g_max);
        return -1;
    }
    double latest = 0.0;
    int head = 0, count = 0;
    for (int w = 0; w < n; w++) {
        pcs[w] = 0;
        queue[w] = w;
        queued[w] = 1;
    }
    count = n;
    while (count > 0) {
        int w = queue[head];
        head = (head + 1) % n;
        count--;
        queued[w] = 0;
        int n_woken = 0;
        const i64 base = off[w], size = off[w + 1] - off[w], total = size * repeat, rbase = roff[w];
        while (pcs[w] < total) {
            const i64 i = pcs[w];
            const i64 copy = size ? i / size : 0;
            const i64 op = base + (i - copy * size);
            const double now = clock[w];
            const int c = code[op];
            if (c == OP_COMPUTE) {
                clock[w] = ends[rbase + i] = now + dur[op];
            } else if (c == OP_SEND) {
                const int peer = a[op];
                const i64 l = b[op];
                const double begin = now >= link_free[l] ? now : link_free[l];
                link_free[l] = begin + dur[op];
                const double arr = begin + dur[op] + latency;
                arrival[rbase + i] = arr;
                if (!is_woken[peer]) { is_woken[peer] = 1; woken[n_woken++] = peer; }
                if (arr > latest) latest = arr;
                ends[rbase + i] = now;
            } else if (c == OP_RECV) {
                const int src = a[op];
                const i64 ssize = off[src + 1] - off[src];
                const i64 sent = copy * ssize + b[op];
                if (pcs[src] <= sent) break; /* not sent yet */
                const double arr = arrival[roff[src] + sent];
                clock[w] = ends[rbase + i] = arr > now ? arr : now;
            } else { /* OP_COLLECTIVE */
                const int g = a[op];
                if (!registered[w]) {
                    registered[w] = 1;
                    if (g_count[g] == 0 || now > g_max[g]) g_max[g] = now;
                    g_count[g]++;
                }
                if (g_count[g] < goff[g + 1] - goff[g]) break;
                const double begin = g_max[g];
                for (i64 k = goff[g]; k < goff[g + 1]; k++) {
                    const int m = gmem[k];
                    const i64 msize = off[m + 1] - off[m];
                    const i64 j = pcs[m];
                    const double end = begin + dur[off[m] + j % msize];
                    ends[roff[m] + j] = end;
                    clock[m] = end;
                    pcs[m]++;
                    registered[m] = 0;
                    if (!is_woken[m]) { is_woken[m] = 1; woken[n_woken++] = m; }
                }
                g_count[g] = 0;
                continue;
            }
            pcs[w]++;
        }
        for (int k = 0; k < n_woken; k++) {
            const int v = woken[k];
            is_woken[v] = 0;
            if (!queued[v]) {
                queued[v] = 1;
                queue[(head + count) % n] = v;
                count++;
            }
        }
    }
    for (int k = 0; k < n_iter; k++) iter_ends[k] = 0.0;
    for (int w = 0; w < n; w++) {
        const i64 base = off[w], size = off[w + 1] - off[w];
        int k = 0;
        for (i64 i = 0; i < pcs[w]; i++) {
            const i64 op = base + i % size;
            if (is_opt[op]) {
                if (k < n_iter && ends[roff[w] + i] > iter_ends[k]) iter_ends[k] = ends[roff[w] + i];
                k++;
            }
        }
    }
    free(clock); free(link_free); free(queue); free(queued); free(registered); free(woken);
    free(is_woken); free(g_count); free(g_max);
    *last_arrival = latest;
    return 0;
}

/* Action kinds, in ActionKind's declaration order (ds_resilience/ir/action.py). */
enum { K_F, K_B, K_W, K_BW, K_SA, K_RA, K_SG, K_RG, K_RD, K_OPT, K_TR, K_CS, K_CR };

/* The validator's rules 1-5 (ds_resilience/ir/validate.py), returning 0 when every one holds and
 * a positive rule number at the first violation; the Python validator then runs to name it.
 * Fields a kind does not have are ignored (Action's own checks guarantee they are None).
 * tied_member[g * pp + s]: stage s is in tied group g (at most 64 groups). forwards: dp*pp*mbs
 * zeroed counters. Scratch per worker: 8 * dp * mbs int32 (state, in_iteration, ra, rg, F, bwd,
 * sa, sg per key of the worker's stage). */
int dsr_check(int dp, int pp, int mbs, int iterations, int n_tied, const uint8_t *tied_member,
              const uint8_t *failed, const i64 *off, const int32_t *kind, const int32_t *stage,
              const i64 *mb, const i64 *pipe, const i64 *peer, int32_t *forwards)
{
    const int n = dp * pp, last = pp - 1;
    const i64 keys = (i64)dp * mbs;
    if (n_tied > 64) return 99;
    int32_t *scratch = calloc((size_t)(8 * keys), sizeof(int32_t));
    i64 *touched = malloc(sizeof(i64) * (size_t)(keys > 0 ? keys : 1));
    if (!scratch || !touched) { free(scratch); free(touched); return -1; }
    int32_t *st = scratch, *in_it = scratch + keys, *ra = scratch + 2 * keys, *rg = scratch + 3 * keys,
            *nf = scratch + 4 * keys, *nb = scratch + 5 * keys, *sa = scratch + 6 * keys, *sg = scratch + 7 * keys;
    int rc = 0;
    /* rule 1: shape */
    for (int w = 0; w < n && !rc; w++) {
        const int s_w = w / dp;
        for (i64 i = off[w]; i < off[w + 1]; i++) {
            const int k = kind[i];
            if (stage[i] != s_w) { rc = 1; break; }
            const int has_pipe = !(k == K_RD || k == K_OPT || k == K_TR || k == K_CS || k == K_CR);
            if (has_pipe && (pipe[i] < 0 || pipe[i] >= dp)) { rc = 1; break; }
            if (k == K_TR) {
                if (mb[i] < 0 || mb[i] >= n_tied || !tied_member[mb[i] * pp + s_w]) { rc = 1; break; }
                continue;
            }
            const int has_mb = !(k == K_RD || k == K_OPT);
            if (has_mb && k != K_CS && k != K_CR && (mb[i] < 0 || mb[i] >= mbs)) { rc = 1; break; }
            const int has_peer = (k >= K_SA && k <= K_RG) || k == K_CS || k == K_CR;
            if (!has_peer) continue;
            if (peer[i] < 0 || peer[i] >= n || peer[i] == w || failed[peer[i]]) { rc = 1; break; }
            int want; /* the stage a message's peer holds; checkpoint chunks go to any stage */
            if (k == K_SA || k == K_RG) want = s_w + 1;
            else if (k == K_RA || k == K_SG) want = s_w - 1;
            else continue;
            if (peer[i] / dp != want) { rc = 1; break; }
        }
    }
    /* rules 2 and 5: order on each worker, the optimizer's tail */
    for (int w = 0; w < n && !rc; w++) {
        if (failed[w]) continue;
        const int s_w = w / dp;
        memset(scratch, 0, sizeof(int32_t) * (size_t)(8 * keys));
        uint64_t due = 0, done = 0;
        for (int g = 0; g < n_tied; g++)
            if (tied_member[g * pp + s_w]) due |= (uint64_t)1 << g;
        int reduced = 0, reduces = 0, steps = 0;
        i64 open = 0, n_touched = 0;
        for (i64 i = off[w]; i < off[w + 1] && !rc; i++) {
            const int k = kind[i];
            if (k == K_TR) {
                const uint64_t bit = (uint64_t)1 << mb[i];
                if (!reduced || (done & bit)) { rc = 2; break; }
                done |= bit;
                continue;
            }
            const int compute = k == K_F || k == K_B || k == K_W || k == K_BW;
            if (reduced && (compute || k == K_RD)) { rc = 5; break; }
            const i64 key = (k == K_RD || k == K_OPT || k == K_CS || k == K_CR) ? -1 : pipe[i] * mbs + mb[i];
            switch (k) {
            case K_F:
                if (st[key] != 0 || in_it[key]) { rc = 2; break; }
                if (s_w > 0 && ra[key] <= nf[key]) { rc = 2; break; }
                st[key] = 1; open++;
                nf[key]++;
                in_it[key] = 1; touched[n_touched++] = key;
                forwards[((i64)pipe[i] * pp + s_w) * mbs + mb[i]]++;
                break;
            case K_B: case K_BW:
                if (st[key] != 1) { rc = 2; break; }
                if (s_w < last && rg[key] <= nb[key]) { rc = 2; break; }
                if (k == K_B) st[key] = 2; else { st[key] = 0; open--; }
                nb[key]++;
                break;
            case K_W:
                if (st[key] != 2) { rc = 2; break; }
                st[key] = 0; open--;
                break;
            case K_RA: ra[key]++; break;
            case K_RG: rg[key]++; break;
            case K_SA: if (++sa[key] > nf[key]) rc = 2; break;
            case K_SG: if (++sg[key] > nb[key]) rc = 2; break;
            case K_RD:
                if (open) { rc = 5; break; }
                reduced = 1; reduces++;
                break;
            case K_OPT:
                if (!reduced || (due & ~done)) { rc = 5; break; }
                done = 0; reduced = 0; steps++;
                for (i64 t = 0; t < n_touched; t++) in_it[touched[t]] = 0;
                n_touched = 0;
                break;
            default: break; /* checkpoint messages: no order rule */
            }
        }
        if (!rc && (reduces != iterations || steps != iterations || reduced)) rc = 5;
    }
    /* rule 3: coverage */
    for (i64 j = 0; j < (i64)n * mbs && !rc; j++)
        if (forwards[j] != iterations) rc = 3;
    free(scratch); free(touched);
    return rc;
}

/* Per worker, the memory-weighted peak of its micro-batch states and the peaks of the three counts
 * (activations F..B, pending W B..W, their sum), in action order, with the same double operations
 * as ds_resilience/planning/memory.py. act_w/w_w: per stage. */
void dsr_peaks(int n, int dp, const i64 *off, const int32_t *kind, const double *act_w, const double *w_w,
               double *peak, int32_t *acts, int32_t *pend, int32_t *state)
{
    for (int w = 0; w < n; w++) {
        const double aw = act_w[w / dp], ww = w_w[w / dp];
        double held = 0.0, top = 0.0;
        int32_t a = 0, p = 0, pa = 0, pw = 0, ps = 0;
        for (i64 i = off[w]; i < off[w + 1]; i++) {
            const int k = kind[i];
            if (k == K_F) { held += aw; a++; }
            else if (k == K_BW) { held -= aw; a--; }
            else if (k == K_B) { held += ww - aw; a--; p++; }
            else if (k == K_W) { held -= ww; p--; }
            else continue;
            if (held > top) top = held;
            if (a > pa) pa = a;
            if (p > pw) pw = p;
            if (a + p > ps) ps = a + p;
        }
        peak[w] = top; acts[w] = pa; pend[w] = pw; state[w] = ps;
    }
}

/* The list scheduler's event loop (ds_resilience/planning/list_scheduler.py), the same choices in
 * the same order: every worker woken at an instant, in worker order, runs a ready B (unless its
 * pending-W cap forces a W), else a ready F within its caps, else a pending W. Ready work sits in
 * per-worker heaps ordered by (arrival, micro-batch, pipeline); the event heap by (time, worker).
 * Writes the emitted tasks in emission order (worker, kind 0=F 1=B 2=W 3=BW, pipeline,
 * micro-batch) and the makespan; returns the number of tasks, or -1 (out of memory) or -2 (stuck:
 * the caps make the placement unschedulable; the Python scheduler then names why). */
typedef struct { double t; int32_t m, p; } Ready;
typedef struct { double t; int32_t w; } Event;

static int ready_less(const Ready *a, const Ready *b)
{
    if (a->t != b->t) return a->t < b->t;
    if (a->m != b->m) return a->m < b->m;
    return a->p < b->p;
}

static int event_less(const Event *a, const Event *b)
{
    return a->t < b->t || (a->t == b->t && a->w < b->w);
}

/* A binary min-heap of T ordered by LESS: NAME_push and NAME_pop (the two heaps above share it). */
#define DEFINE_HEAP(NAME, T, LESS)                                \
    static void NAME##_push(T *h, i64 *len, T x)                  \
    {                                                             \
        i64 i = (*len)++;                                         \
        while (i > 0) {                                           \
            i64 up = (i - 1) / 2;                                 \
            if (!LESS(&x, &h[up])) break;                         \
            h[i] = h[up];                                         \
            i = up;                                               \
        }                                                         \
        h[i] = x;                                                 \
    }                                                             \
    static T NAME##_pop(T *h, i64 *len)                           \
    {                                                             \
        T top = h[0], x = h[--(*len)];                            \
        i64 i = 0, size = *len;                                   \
        for (;;) {                                                \
            i64 c = 2 * i + 1;                                    \
            if (c >= size) break;                                 \
            if (c + 1 < size && LESS(&h[c + 1], &h[c])) c++;      \
            if (!LESS(&h[c], &x)) break;                          \
            h[i] = h[c];                                          \
            i = c;                                                \
        }                                                         \
        if (size > 0) h[i] = x;                                   \
        return top;                                               \
    }

DEFINE_HEAP(ready, Ready, ready_less)
DEFINE_HEAP(event, Event, event_less)

static int int_cmp(const void *a, const void *b)
{
    return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b);
}

i64 dsr_list_schedule(int dp, int pp, int mbs, int split, const int32_t *owner /* [(p*pp+s)*mbs+m] */,
                      const double *t_f, const double *t_b, const double *t_w, const double *t_bw,
                      const double *links, const int32_t *act_caps, const int32_t *w_caps /* -1: none */,
                      const double *mem_caps /* INFINITY: none */, const double *start, const double *act_weight,
                      const double *w_weight, int32_t *o_w, int32_t *o_kind, int32_t *o_p, int32_t *o_m,
                      double *makespan_out)
{
    const int n = dp * pp, last = pp - 1;
    const i64 keys = (i64)dp * pp * mbs;
    i64 *count = calloc((size_t)n + 1, sizeof(i64));
    i64 *hoff = calloc((size_t)n + 1, sizeof(i64));
    if (!count || !hoff) { free(count); free(hoff); return -1; }
    for (i64 k = 0; k < keys; k++) count[owner[k]]++;
    for (int w = 0; w < n; w++) hoff[w + 1] = hoff[w] + count[w];
    Ready *fh = malloc(sizeof(Ready) * (size_t)(keys + 1));
    Ready *bh = malloc(sizeof(Ready) * (size_t)(keys + 1));
    Ready *pend = malloc(sizeof(Ready) * (size_t)(keys + 1)); /* FIFO of (_, m, p) per worker */
    i64 *flen = calloc((size_t)n, sizeof(i64)), *blen = calloc((size_t)n, sizeof(i64));
    i64 *phead = calloc((size_t)n, sizeof(i64)), *ptail = calloc((size_t)n, sizeof(i64));
    const i64 ecap = 6 * keys + n + 8;
    Event *ev = malloc(sizeof(Event) * (size_t)ecap);
    double *free_at = malloc(sizeof(double) * (size_t)n), *held = calloc((size_t)n, sizeof(double));
    int32_t *in_flight = calloc((size_t)n, sizeof(int32_t));
    int *woken = malloc(sizeof(int) * (size_t)n);
    uint8_t *mark = calloc((size_t)n, 1);
    i64 rc = 0;
    if (!fh || !bh || !pend || !flen || !blen || !phead || !ptail || !ev || !free_at || !held || !in_flight || !woken
        || !mark) { rc = -1; goto out; }
    for (int p = 0; p < dp; p++)
        for (int m = 0; m < mbs; m++) {
            const int w = owner[((i64)p * pp + 0) * mbs + m];
            Ready x = {0.0, m, p};
            ready_push(fh + hoff[w], &flen[w], x);
        }
    i64 elen = 0;
    for (int w = 0; w < n; w++) {
        free_at[w] = start[w];
        if (count[w]) { Event e = {start[w], w}; event_push(ev, &elen, e); }
    }
    i64 remaining = keys * (split ? 3 : 2), emitted = 0;
    double makespan = 0.0;
    while (remaining) {
        if (!elen) { rc = -2; goto out; }
        Event first = event_pop(ev, &elen);
        const double t = first.t;
        int nw = 0;
        woken[nw++] = first.w; mark[first.w] = 1;
        while (elen && ev[0].t <= t) {
            Event e = event_pop(ev, &elen);
            if (!mark[e.w]) { mark[e.w] = 1; woken[nw++] = e.w; }
        }
        qsort(woken, (size_t)nw, sizeof(int), int_cmp);
        for (int k = 0; k < nw; k++) mark[woken[k]] = 0;
        for (int k = 0; k < nw; k++) {
            const int w = woken[k], s = w / dp;
            if (free_at[w] > t) continue;
            Ready *wb = bh + hoff[w], *wf = fh + hoff[w], *wp = pend + hoff[w];
            const int has_b = blen[w] && wb[0].t <= t;
            const int has_f = flen[w] && wf[0].t <= t;
            const i64 n_pend = ptail[w] - phead[w];
            const int must_w = split && n_pend && w_caps[w] >= 0 && n_pend >= w_caps[w];
            double aw = act_weight[w];
            const double ww = w_weight[w];
            if (split) aw = aw >= ww ? aw : ww;
            const int mem_full = held[w] + aw > mem_caps[w] + 1e-9;
            double end;
            int kind;
            Ready x;
            if (has_b && !must_w) {
                x = ready_pop(wb, &blen[w]);
                in_flight[w]--;
                if (split) {
                    kind = 1; end = t + t_b[s];
                    wp[ptail[w]++] = x;
                    held[w] += ww - aw;
                } else {
                    kind = 3; end = t + t_bw[s];
                    held[w] -= aw;
                }
            } else if (has_f && in_flight[w] < act_caps[w] && !mem_full) {
                x = ready_pop(wf, &flen[w]);
                in_flight[w]++;
                held[w] += aw;
                kind = 0; end = t + t_f[s];
            } else if (n_pend) {
                x = wp[phead[w]++];
                held[w] -= ww;
                kind = 2; end = t + t_w[s];
            } else {
                continue;
            }
            o_w[emitted] = w; o_kind[emitted] = kind; o_p[emitted] = x.p; o_m[emitted] = x.m;
            emitted++;
            free_at[w] = end;
            { Event e = {end, w}; event_push(ev, &elen, e); }
            remaining--;
            if ((kind == 1 || kind == 3) && s > 0) {
                const double arrival = end + links[s - 1];
                const int o = owner[((i64)x.p * pp + s - 1) * mbs + x.m];
                Ready r = {arrival, x.m, x.p};
                ready_push(bh + hoff[o], &blen[o], r);
                Event e = {arrival, o};
                event_push(ev, &elen, e);
            } else if (kind == 0) {
                if (s == last) { Ready r = {0.0, x.m, x.p}; ready_push(wb, &blen[w], r); }
                if (s < last) {
                    const double arrival = end + links[s];
                    const int o = owner[((i64)x.p * pp + s + 1) * mbs + x.m];
                    Ready r = {arrival, x.m, x.p};
                    ready_push(fh + hoff[o], &flen[o], r);
                    Event e = {arrival, o};
                    event_push(ev, &elen, e);
                }
            }
            if (end > makespan) makespan = end;
        }
    }
    rc = emitted;
    *makespan_out = makespan;
out:
    free(count); free(hoff); free(fh); free(bh); free(pend); free(flen); free(blen); free(phead); free(ptail);
    free(ev); free(free_at); free(held); free(in_flight); free(woken); free(mark);
    return rc;
}
