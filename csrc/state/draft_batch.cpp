#include "state/draft_batch.h"
#include "core/error.h"
#include "models/head.h"
#include "models/sequences.h"

namespace pdf {

// batch draft graphs kept built: a batch changes shape as its sessions' windows grow (one rebuild per window step)
static constexpr size_t MAX_CACHED_GRAPHS = 4;

struct draft_batch::compiled {
    explicit compiled(graph_arena & arena) : cache(arena) {}
    graph_cache                              cache;
    std::vector<key_entry>                   keys;
    draft_inputs                             in;
    std::vector<draft_session::call_inputs>  inputs;   // by part
    std::vector<draft_session::call_outputs> outputs;  // by part
    uint64_t                                 last_use = 0;
};

draft_batch::draft_batch(std::shared_ptr<const dflash_draft> draft)
    : draft_(std::move(draft)),
      compute_(std::make_shared<compute_backends>(draft_->target().devices())),
      arena_(*compute_) {}

draft_batch::~draft_batch() = default;

int draft_batch::block_of(const part & p) {
    return p.n_block > 0 ? p.n_block : p.d->block();
}

bool draft_batch::batches(const std::vector<part> & parts) const {
    if (parts.size() < 2) {
        return false;
    }
    const draft_session * first = parts[0].d;
    for (size_t i = 0; i < parts.size(); ++i) {
        const draft_session * d = parts[i].d;
        if (!d || !first || &d->model() != draft_.get() || d->block_ != first->block_ ||
            block_of(parts[i]) != block_of(parts[0]) || d->readout_k() != first->readout_k() ||
            d->with_logprobs_ != first->with_logprobs_) {
            return false;
        }
        for (size_t j = 0; j < i; ++j) {
            if (parts[j].d == d) {
                return false;
            }
        }
    }
    return true;
}

void draft_batch::draft(const std::vector<part> & given) {
    const std::vector<part> parts = in_session_order(given, [](const part & p) { return p.d->id_; });
    if (!batches(parts)) {
        throw std::invalid_argument("draft_batch: these drafts cannot share a graph (see batches())");
    }
    std::vector<draft_session::call> calls;
    for (const part & p : parts) {
        calls.push_back(p.d->prepare_draft(p.anchor, p.start, p.n_block));
    }
    compiled & g = graph_for(parts, calls);
    g.cache.allocate(format("the draft graph of a batch of %zu sessions", parts.size()).c_str());
    for (size_t i = 0; i < parts.size(); ++i) {
        parts[i].d->set_inputs(calls[i], g.inputs[i]);
    }
    {
        const compute_backends::step step(*compute_);  // on all the model's threads
        g.cache.compute("the batch's draft graph");
    }
    for (size_t i = 0; i < parts.size(); ++i) {
        parts[i].d->after_compute(calls[i]);
        parts[i].d->read_proposals(g.outputs[i], calls[i].n_block);
    }
}

draft_batch::compiled & draft_batch::graph_for(const std::vector<part> & parts,
                                               const std::vector<draft_session::call> & calls) {
    std::vector<key_entry> keys;
    for (size_t i = 0; i < parts.size(); ++i) {
        keys.push_back({parts[i].d->id_, calls[i].n_rows, calls[i].n_block, calls[i].n_kv});
    }
    if (compiled * kept = kept_graph(graphs_, keys, ++uses_)) {
        return *kept;
    }
    compiled & g = entry_for_new_graph(graphs_, MAX_CACHED_GRAPHS, [&] { return std::make_unique<compiled>(arena_); });
    g.last_use   = uses_;
    g.keys       = keys;
    build(g, parts, calls);
    return g;
}

// every session's context rows and block through the drafter: hidden [E, S*(B-1)] -> the head's top-k per row
// (DFlash2: each block's lattice, [k, k, S*(B-1)])
void draft_batch::build(compiled & g, const std::vector<part> & parts, const std::vector<draft_session::call> & calls) {
    const int64_t  S = (int64_t) parts.size(), B = calls[0].n_block;
    ggml_context * ctx = g.cache.begin(S * (draft_->max_graph_nodes() + 64));
    ggml_cgraph *  gf  = g.cache.graph();
    add_parts(ctx, g, parts, calls);
    ggml_tensor *        hidden = draft_->build(ctx, gf, g.in, state_tensors{});
    const target_model & target = draft_->target();
    const bool           dflash2 = draft_->dflash2().present();
    const draft_session & d0    = *parts[0].d;
    const head_outputs   head   = build_top_k_readout(ctx, gf, target.output_head(), hidden, target.head_on_host(),
                                                      d0.readout_k(), d0.with_logprobs_ || dflash2);
    ggml_tensor * lattice = nullptr;
    if (dflash2) {
        std::vector<ggml_tensor *> each;
        for (int64_t i = 0; i < S; ++i) {
            ggml_tensor * anchor = ggml_view_1d(ctx, g.in.tokens, 1, (size_t) (i * B) * sizeof(int32_t));
            ggml_tensor * rows   = token_range(ctx, hidden, 1, i * (B - 1), B - 1);
            each.push_back(build_dflash2_lattice(ctx, draft_->selector(), rows,
                                                 token_range(ctx, head.top_ids, 1, i * (B - 1), B - 1), anchor));
        }
        lattice = join_tokens(ctx, each, 2);
        ggml_build_forward_expand(gf, lattice);
    }
    for (int64_t i = 0; i < S; ++i) {
        g.outputs.push_back({head.top_ids, head.top_logprobs, lattice, i * (B - 1)});
    }
}

size_t draft_batch::measure(const std::vector<draft_session *> & sessions, int n_rows, int n_block, int n_kv) {
    std::vector<part>                parts;
    std::vector<draft_session::call> calls;
    for (draft_session * d : sessions) {
        if (!d || d->draft_ != draft_ || n_block <= 0 || n_block > d->block() || n_rows < 0 || n_kv < n_block ||
            n_kv > d->n_slots_) {
            throw std::invalid_argument(format("draft_batch::measure: %d rows and a block of %d over %d cache slots "
                                               "(a session of this batch's drafter)", n_rows, n_block, n_kv));
        }
        parts.push_back({d, 0, 0, n_block});
        calls.push_back({n_rows, n_rows, n_block, n_kv, n_rows, 0, 0});
    }
    if (parts.empty()) {
        throw std::invalid_argument("draft_batch::measure: no sessions");
    }
    compiled g(arena_);
    build(g, parts, calls);
    return g.cache.measure();
}

void draft_batch::add_parts(ggml_context * ctx, compiled & g, const std::vector<part> & parts,
                            const std::vector<draft_session::call> & calls) {
    const int64_t S = (int64_t) parts.size(), R = calls[0].n_rows, B = calls[0].n_block;
    const bool    swa = draft_->swa_window() > 0;
    auto input = [&](ggml_type type, int64_t n0, int64_t n1 = 1) {
        ggml_tensor * t = n1 == 1 ? ggml_new_tensor_1d(ctx, type, n0) : ggml_new_tensor_2d(ctx, type, n0, n1);
        ggml_set_input(t);
        return t;
    };
    g.in            = draft_inputs{};
    g.in.n_ctx_rows = (int) R;
    g.in.n_block    = (int) B;
    g.in.ctx_pos    = input(GGML_TYPE_I32, S * R);
    g.in.tokens     = input(GGML_TYPE_I32, S * B);
    g.in.pos        = input(GGML_TYPE_I32, S * B);
    g.inputs.clear();
    g.outputs.clear();
    std::vector<ggml_tensor *> feats;
    for (int64_t i = 0; i < S; ++i) {
        const draft_session & d = *parts[i].d;
        draft_session::call_inputs io;
        io.ring_rows   = input(GGML_TYPE_I32, R);
        io.ctx_pos     = g.in.ctx_pos;
        io.ctx_slots   = input(GGML_TYPE_I64, R);
        io.tokens      = g.in.tokens;
        io.pos         = g.in.pos;
        io.slots       = input(GGML_TYPE_I64, B);
        io.kq_mask     = input(GGML_TYPE_F16, calls[i].n_kv, B);
        io.kq_mask_swa = swa ? input(GGML_TYPE_F16, calls[i].n_kv, B) : nullptr;
        io.ctx_first   = i * R;
        io.first       = i * B;
        g.inputs.push_back(io);
        feats.push_back(ggml_get_rows(ctx, d.ring_->rows(), io.ring_rows));  // [n_ext*E, R], on the device
        draft_sequence q{io.ctx_first, io.first, io.ctx_slots, io.slots, io.kq_mask, io.kq_mask_swa, calls[i].n_kv, {}};
        d.kv_->fill(q.st, draft_->info().n_layer);
        g.in.sequences.push_back(q);
    }
    g.in.ctx_feats = join_tokens(ctx, feats, 1);
}

}  // namespace pdf
