#include "state/mtp_batch.h"
#include "core/error.h"
#include "models/head.h"
#include "models/sequences.h"

namespace pdf {

// batch graphs kept built: step 0's and a later step's, as the heads' windows grow (one rebuild per window step)
static constexpr size_t MAX_CACHED_GRAPHS = 4;

struct mtp_batch::compiled {
    explicit compiled(graph_arena & arena) : cache(arena) {}
    graph_cache                cache;
    std::vector<key_entry>     keys;
    eval_inputs                in;
    std::vector<ggml_tensor *> ring_rows;     // by head, I32 [R] (step 0; none from the carry)
    ggml_tensor *              top_ids      = nullptr;  // I32 [k, S]
    ggml_tensor *              top_logprobs = nullptr;  // F32 [k, S]
    uint64_t                   last_use     = 0;
};

mtp_batch::mtp_batch(std::shared_ptr<const target_model> target)
    : target_(std::move(target)),
      compute_(std::make_shared<compute_backends>(target_->devices())),
      arena_(*compute_) {}

mtp_batch::~mtp_batch() = default;

bool mtp_batch::batches(const std::vector<part> & parts) const {
    if (parts.size() < 2) {
        return false;
    }
    const mtp_session * first = parts[0].h;
    for (size_t i = 0; i < parts.size(); ++i) {
        const mtp_session * h = parts[i].h;
        if (!h || !first || h->target_.get() != target_.get() || parts[i].first != parts[0].first ||
            h->block_ != first->block_ || h->top_k_ != first->top_k_ || h->with_logprobs_ != first->with_logprobs_) {
            return false;
        }
        for (size_t j = 0; j < i; ++j) {
            if (parts[j].h == h) {
                return false;
            }
        }
    }
    return true;
}

void mtp_batch::draft(const std::vector<part> & given) {
    const std::vector<part> parts = in_session_order(given, [](const part & p) { return p.h->id_; });
    if (!batches(parts)) {
        throw std::invalid_argument("mtp_batch: these steps cannot share a graph (see batches())");
    }
    std::vector<mtp_session::step_rows> rows;
    for (const part & p : parts) {
        rows.push_back(p.first ? p.h->prepare_begin(p.anchor, p.start, p.h_row) : p.h->prepare_next());
    }
    compiled & g = graph_for(parts, rows);
    g.cache.allocate(format("the MTP graph of a batch of %zu sessions", parts.size()).c_str());
    set_inputs(g, rows);
    {
        const compute_backends::step step(*compute_);  // on all the model's threads
        g.cache.compute("the batch's MTP graph");
    }
    for (size_t i = 0; i < parts.size(); ++i) {
        mtp_session & h = *parts[i].h;
        h.appended(rows[i].n_queued);
        h.read_step(g.top_ids, g.top_logprobs, (int) i, parts[i].first ? 0 : h.proposals_.n_positions);
    }
}

mtp_batch::compiled & mtp_batch::graph_for(const std::vector<part> & parts,
                                           const std::vector<mtp_session::step_rows> & rows) {
    std::vector<key_entry>     keys;
    std::vector<mtp_session *> heads;
    std::vector<int>           n_kv;
    for (size_t i = 0; i < parts.size(); ++i) {
        heads.push_back(parts[i].h);
        n_kv.push_back(parts[i].h->window_for(rows[i].positions.back()));
        keys.push_back({parts[i].h->id_, n_kv.back(), parts[i].first});
    }
    if (compiled * kept = kept_graph(graphs_, keys, ++uses_)) {
        return *kept;
    }
    compiled & g = entry_for_new_graph(graphs_, MAX_CACHED_GRAPHS, [&] { return std::make_unique<compiled>(arena_); });
    g.last_use   = uses_;
    g.keys       = keys;
    build(g, heads, parts[0].first, n_kv);
    return g;
}

// S heads' rows (R each: the block at step 0, else 1) through the head: h [E, S*R] -> each head's last row h'
// [E, S] (into its carry) -> the top-k readout [k, S]
void mtp_batch::build(compiled & g, const std::vector<mtp_session *> & heads, bool first,
                      const std::vector<int> & n_kv) {
    const int64_t  S = (int64_t) heads.size(), R = first ? heads[0]->block_ : 1, E = target_->info().n_embd;
    ggml_context * ctx = g.cache.begin(S * (target_->mtp_graph_nodes() + 64));
    ggml_cgraph *  gf  = g.cache.graph();
    auto input = [&](ggml_type type, int64_t n0, int64_t n1 = 1) {
        ggml_tensor * t = n1 == 1 ? ggml_new_tensor_1d(ctx, type, n0) : ggml_new_tensor_2d(ctx, type, n0, n1);
        ggml_set_input(t);
        return t;
    };
    g.in           = eval_inputs{};
    g.in.n_tokens  = (int) (S * R);
    g.in.tokens    = input(GGML_TYPE_I32, S * R);
    g.in.positions = input(GGML_TYPE_I32, S * R * target_->info().n_pos_per_token);
    g.ring_rows.clear();
    std::vector<ggml_tensor *> states;
    for (int64_t i = 0; i < S; ++i) {
        sequence_inputs q;
        q.first      = (int) (i * R);
        q.n_tokens   = (int) R;
        q.kv.slots   = input(GGML_TYPE_I64, R);
        q.kv.kq_mask = input(GGML_TYPE_F16, n_kv[i], R);
        q.kv.n_kv    = n_kv[i];
        heads[i]->kv_->fill(q.st, target_->mtp_kv_layer().il + 1);
        g.in.sequences.push_back(q);
        if (first) {
            g.ring_rows.push_back(input(GGML_TYPE_I32, R));
            states.push_back(ggml_get_rows(ctx, heads[i]->ring_->rows(), g.ring_rows.back()));
        } else {
            states.push_back(heads[i]->carry_);
        }
    }
    ggml_tensor * h = join_tokens(ctx, states, 1);  // [E, S*R]
    if (first) {  // the ring holds the last layer's output; the trunk's state is after the final norm
        h = target_->build_output_norm(ctx, h);
    }
    ggml_tensor * out = target_->build_mtp(ctx, gf, g.in, state_tensors{}, h, false);  // [E, S*R]
    // each head's last row
    out = ggml_cont(ctx, ggml_view_2d(ctx, out, E, S, R * out->nb[1], (R - 1) * out->nb[1]));  // [E, S]
    for (int64_t i = 0; i < S; ++i) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_view_2d(ctx, out, E, 1, out->nb[1], i * out->nb[1]),
                                               heads[i]->carry_));
    }
    const head_outputs head = build_top_k_readout(ctx, gf, target_->mtp_output_head(), out, target_->head_on_host(),
                                                  heads[0]->top_k_, heads[0]->with_logprobs_);
    g.top_ids      = head.top_ids;
    g.top_logprobs = head.top_logprobs;
}

// every row's token and position (M-RoPE: the text sections all take the position), slot (= position) and mask
// (each row queries: the row at position p sees [1, p]), and at step 0 the ring rows of its state
void mtp_batch::set_inputs(compiled & g, const std::vector<mtp_session::step_rows> & rows) {
    const int n = g.in.n_tokens, n_pos = target_->info().n_pos_per_token;
    std::vector<int32_t> tokens, pos_host((size_t) n * n_pos, 0);
    for (const mtp_session::step_rows & r : rows) {
        tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end());
    }
    for (size_t i = 0; i < rows.size(); ++i) {
        const sequence_inputs &      q = g.in.sequences[i];
        const std::vector<int32_t> & p = rows[i].positions;
        for (int r = 0; r < q.n_tokens; ++r) {
            for (int j = 0; j < std::min(n_pos, 3); ++j) {
                pos_host[(size_t) j * n + q.first + r] = p[r];
            }
        }
        const std::vector<int64_t>     slots(p.begin(), p.end());
        const std::vector<ggml_fp16_t> mask = mtp_session::causal_mask(p, q.kv.n_kv);
        ggml_backend_tensor_set(q.kv.slots, slots.data(), 0, sizeof(int64_t) * slots.size());
        ggml_backend_tensor_set(q.kv.kq_mask, mask.data(), 0, sizeof(ggml_fp16_t) * mask.size());
        if (!g.ring_rows.empty()) {
            ggml_backend_tensor_set(g.ring_rows[i], rows[i].ring_rows.data(), 0, sizeof(int32_t) * p.size());
        }
    }
    ggml_backend_tensor_set(g.in.tokens, tokens.data(), 0, sizeof(int32_t) * n);
    ggml_backend_tensor_set(g.in.positions, pos_host.data(), 0, sizeof(int32_t) * pos_host.size());
}

size_t mtp_batch::measure(const std::vector<mtp_session *> & heads, bool first, int n_kv) {
    if (heads.empty()) {
        throw std::invalid_argument("mtp_batch::measure: no heads");
    }
    for (const mtp_session * h : heads) {
        if (!h || h->target_.get() != target_.get() || n_kv < 1 || n_kv > h->n_ctx_) {
            throw std::invalid_argument(format("mtp_batch::measure: a window of %d cache slots (a head of this "
                                               "batch's target, within its n_ctx)", n_kv));
        }
    }
    compiled g(arena_);
    build(g, heads, first, std::vector<int>(heads.size(), n_kv));
    return g.cache.measure();
}

}  // namespace pdf
