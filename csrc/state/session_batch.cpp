#include "state/session_batch.h"
#include "core/error.h"
#include "models/head.h"
#include "models/sequences.h"

#include <algorithm>

namespace pdf {

// batch graphs kept built: a decoding batch changes shape as its sessions' windows grow and their rounds change
// width, and a rebuild costs about as much as a session's (one per KV window step of any session)
static constexpr size_t MAX_CACHED_GRAPHS = 8;

struct session_batch::compiled {
    explicit compiled(graph_arena & arena) : cache(arena) {}
    graph_cache            cache;
    std::vector<key_entry> keys;
    eval_inputs            in;
    eval_outputs           out;
    head_outputs           head;
    bool                   logits = false;  // the logits are an output (some part reads them)
    std::vector<int32_t>   output_rows;     // in.output_rows, by part: every row, or the last one
    std::vector<int>       first_row;       // by part: its first row in output_rows (and the head's outputs)
    std::vector<int>       n_rows;          // by part: its rows there
    std::vector<std::vector<ggml_tensor *>> captured;   // by part: its capture layers, every token of the batch
    std::vector<ring_set::writes>           ring_rows;  // by part: the feature-ring rows it writes (or none)
    uint64_t                                last_use = 0;
};

session_batch::session_batch(std::shared_ptr<const target_model> model)
    : model_(std::move(model)), compute_(std::make_shared<compute_backends>(model_->devices())), arena_(*compute_) {}

session_batch::~session_batch() = default;

static void check_parts(const std::vector<session_batch::part> & parts, const target_model & model) {
    if (parts.empty()) {
        throw std::invalid_argument("session_batch::eval: no parts");
    }
    int top_k = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        const session_batch::part & p = parts[i];
        if (!p.s || &p.s->model() != &model) {
            throw std::invalid_argument(format("session_batch::eval: part %zu's session is %s", i,
                                               p.s ? "over another model" : "missing"));
        }
        for (size_t j = 0; j < i; ++j) {
            if (parts[j].s == p.s) {
                throw std::invalid_argument(format("session_batch::eval: parts %zu and %zu are one session", j, i));
            }
        }
        if (p.what.top_k > 0 && top_k > 0 && p.what.top_k != top_k) {
            throw std::invalid_argument(format("session_batch::eval: part %zu reads top_k = %d, an earlier part %d",
                                               i, p.what.top_k, top_k));
        }
        top_k = std::max(top_k, p.what.top_k);
    }
}

void session_batch::eval(const std::vector<part> & given) {
    check_parts(given, *model_);
    const std::vector<part> parts = in_session_order(given, [](const part & p) { return p.s->id_; });
    std::vector<batch_order> orders(parts.size());
    std::vector<key_entry>   keys;
    for (size_t i = 0; i < parts.size(); ++i) {
        const part & p = parts[i];
        keys.push_back({p.s->id_, p.s->stage(p.tokens, p.n, p.layout, p.what, p.capture, p.rings, orders[i])});
    }
    compiled & g = graph_for(parts, keys);
    g.cache.allocate(format("the compute graph of a batch of %zu sessions, %d tokens", parts.size(),
                            g.in.n_tokens).c_str());
    std::vector<std::vector<int32_t>> tokens_by_slot(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
        const part &            p = parts[i];
        const sequence_inputs & q = g.in.sequences[i];
        const session::row_inputs where{g.in.tokens, g.in.positions,  q.first,       g.in.n_tokens,
                                        &q.kv,       &q.recurrent,    g.ring_rows[i]};
        tokens_by_slot[i] = p.s->set_inputs(p.tokens, p.n, p.layout, orders[i], p.rings, where);
    }
    set_graph_input(g.in.output_rows, g.output_rows.data(), 0, sizeof(int32_t) * g.output_rows.size());
    {
        const compute_backends::step step(*compute_);  // on all the model's threads
        g.cache.compute("the batch's target graph");
    }
    hand_out(g, parts, orders, tokens_by_slot);
}

void session_batch::hand_out(compiled & g, const std::vector<part> & parts, std::vector<batch_order> & orders,
                             std::vector<std::vector<int32_t>> & tokens_by_slot) {
    for (size_t i = 0; i < parts.size(); ++i) {
        const part &             p = parts[i];
        session::result_tensors r;
        r.argmax       = g.head.argmax;
        r.logits       = p.what.logits ? g.head.logits : nullptr;
        r.top_ids      = p.what.top_k > 0 ? g.head.top_ids : nullptr;
        r.top_logprobs = p.what.top_k > 0 ? g.head.top_logprobs : nullptr;
        if (!g.ring_rows[i].any()) {
            r.captured = g.captured[i];
        }
        r.first_row   = g.first_row[i];
        r.n_rows      = g.n_rows[i];
        r.first_token = g.in.sequences[i].first;
        p.s->take_results(std::move(tokens_by_slot[i]), orders[i].tree(), g.keys[i].key.whole, p.n, p.what,
                          std::move(r));
    }
}

session_batch::compiled & session_batch::graph_for(const std::vector<part> & parts,
                                                   const std::vector<key_entry> & keys) {
    if (compiled * kept = kept_graph(graphs_, keys, ++uses_)) {
        return *kept;
    }
    compiled & g = entry_for_new_graph(graphs_, MAX_CACHED_GRAPHS, [&] { return std::make_unique<compiled>(arena_); });
    g.last_use   = uses_;
    g.keys       = keys;
    build(g, parts);
    return g;
}

// tokens [n_total] (every part's rows, part after part) -> the layers -> the head over each part's output rows
void session_batch::build(compiled & g, const std::vector<part> & parts) {
    int    n_total = 0, top_k = 0;
    size_t n_nodes = 0;
    std::vector<int> capture;  // every part's capture layers
    for (const key_entry & e : g.keys) {
        n_total += e.key.n_tokens;
        top_k = std::max(top_k, e.key.what.top_k);
        n_nodes += model_->max_graph_nodes((int) e.key.tree_levels.size(), e.key.n_tokens) + 16;
        capture.insert(capture.end(), e.key.capture.begin(), e.key.capture.end());
    }
    std::sort(capture.begin(), capture.end());
    capture.erase(std::unique(capture.begin(), capture.end()), capture.end());
    ggml_context * ctx = g.cache.begin(n_nodes);
    ggml_cgraph *  gf  = g.cache.graph();

    eval_inputs & in = g.in;
    in                = eval_inputs{};
    in.n_tokens       = n_total;
    in.all_outputs    = true;
    in.capture_layers = capture;
    in.tokens         = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_total);
    in.positions = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) n_total * model_->info().n_pos_per_token);
    ggml_set_input(in.tokens);
    ggml_set_input(in.positions);
    add_parts(ctx, g, parts);
    in.output_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) g.output_rows.size());
    ggml_set_input(in.output_rows);

    g.out    = model_->build_eval(ctx, gf, in, state_tensors{});
    g.head   = build_head(ctx, model_->output_head(), g.out.hidden, model_->head_on_host(), top_k);
    g.logits = std::any_of(g.keys.begin(), g.keys.end(), [](const key_entry & e) { return e.key.what.logits; });
    for (ggml_tensor * t : {g.head.argmax, g.logits ? g.head.logits : nullptr, g.head.top_ids, g.head.top_logprobs}) {
        if (t) {
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
        }
    }
    add_captures(ctx, gf, g, parts);
}

// each part's rows: its memory's inputs and its output rows (every row, or the last one)
void session_batch::add_parts(ggml_context * ctx, compiled & g, const std::vector<part> & parts) {
    g.output_rows.clear();
    g.first_row.clear();
    g.n_rows.clear();
    int first = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
        const session::graph_key & key = g.keys[i].key;
        sequence_inputs            q;
        q.first    = first;
        q.n_tokens = key.n_tokens;
        parts[i].s->add_memory_inputs(ctx, key, q.kv, q.recurrent);
        parts[i].s->fill_state(q.st);
        g.in.sequences.push_back(std::move(q));
        g.first_row.push_back((int) g.output_rows.size());
        for (int r = key.what.all_rows ? 0 : key.n_tokens - 1; r < key.n_tokens; ++r) {
            g.output_rows.push_back(first + r);
        }
        g.n_rows.push_back((int) g.output_rows.size() - g.first_row.back());
        first += key.n_tokens;
    }
}

size_t session_batch::measure(const std::vector<shape> & shapes) {
    if (shapes.empty()) {
        throw std::invalid_argument("session_batch::measure: no parts");
    }
    compiled          g(arena_);
    std::vector<part> parts;
    for (const shape & p : shapes) {
        if (!p.s || &p.s->model() != model_.get() || p.n_tokens <= 0 || p.n_kv < p.n_tokens ||
            (uint32_t) p.n_kv > p.s->kv_->n_ctx()) {
            throw std::invalid_argument(format("session_batch::measure: a part of %d tokens over %d cache slots (a "
                                               "session over this batch's model, n_tokens <= n_kv <= n_ctx)",
                                               p.n_tokens, p.n_kv));
        }
        g.keys.push_back({p.s->id_, p.s->key_for(p.n_tokens, p.n_kv, p.tree_levels, p.whole, p.what, p.capture,
                                                 p.rings)});
        part q;
        q.s       = p.s;
        q.n       = p.n_tokens;
        q.what    = g.keys.back().key.what;
        q.capture = p.capture;
        q.rings   = p.capture.empty() ? ring_set{} : p.rings;
        parts.push_back(q);
    }
    build(g, parts);
    return g.cache.measure();
}

// each part's captures: written into its ring by the graph, else read back from the whole batch's
void session_batch::add_captures(ggml_context * ctx, ggml_cgraph * gf, compiled & g, const std::vector<part> & parts) {
    const std::vector<int> & capture = g.in.capture_layers;  // (sorted)
    g.captured.assign(parts.size(), {});
    g.ring_rows.assign(parts.size(), {});
    for (size_t i = 0; i < parts.size(); ++i) {
        const session::graph_key & key = g.keys[i].key;
        for (int c : key.capture) {
            const size_t j = std::lower_bound(capture.begin(), capture.end(), c) - capture.begin();
            g.captured[i].push_back(g.out.captured[j]);
        }
        if (key.capture.empty()) {
            continue;
        }
        if (key.ring_ids[0] != 0) {
            std::vector<ggml_tensor *> mine;
            for (ggml_tensor * t : g.captured[i]) {
                mine.push_back(token_range(ctx, t, 1, g.in.sequences[i].first, key.n_tokens));
            }
            g.ring_rows[i] = parts[i].rings.add_writes(ctx, gf, mine, key.n_tokens);
        } else {
            for (ggml_tensor * t : g.captured[i]) {
                ggml_set_output(t);
                ggml_build_forward_expand(gf, t);
            }
        }
    }
}

}  // namespace pdf
