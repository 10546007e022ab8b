// Everything mutable about one conversation with a target model: the KV cache, the recurrent state, the
// committed tokens and the current evaluation graph. The model is shared and read-only.
//
// Basic usage:
//   pdf::session s(model, params);
//   s.eval(tokens, n, {}, read_argmax_all);  // writes cache slots n_past .. n_past+n-1
//   s.commit(n_accepted);                    // keeps the first n_accepted of them (a chain)
// Tree verification:
//   s.eval(tokens, n, {positions, nullptr, parents}, read_argmax_all);  // node i sees its ancestors only
//   s.commit({0, 3, 7});                      // keeps the path root -> 3 -> 7: KV rows compacted, recurrent
//                                             // state of node 7, no replay
//
// A session is not thread-safe; use one per thread (several may share one model).
#pragma once

#include "core/graph_cache.h"
#include "models/model.h"
#include "state/batch_order.h"
#include "state/feature_ring.h"
#include "state/kv_cache.h"
#include "state/recurrent_state.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace pdf {

struct session_params {
    uint32_t  n_ctx      = 4096;
    uint32_t  n_ubatch   = 512;  // prefill micro-batch
    uint32_t  n_rollback = 16;   // hybrid models: an eval of up to this many tokens (or tree nodes) can be
                                 // committed at any token
    ggml_type type_k     = GGML_TYPE_F16;
    ggml_type type_v     = GGML_TYPE_F16;
};

// What an evaluation reads back (the greedy pick of the read rows always comes with it)
struct readout {
    bool all_rows = false;  // every token's, else the last token's only
    bool logits   = false;  // the full logits
    int  top_k    = 0;      // the k most likely tokens with their log-probabilities
};
inline constexpr readout read_argmax_last{false, false, 0};
inline constexpr readout read_argmax_all{true, false, 0};
inline constexpr readout read_logits_last{false, true, 0};
inline constexpr readout read_logits_all{true, true, 0};

// How the batch of one evaluation relates to the committed past and to itself (all optional)
struct batch_layout {
    const int32_t * positions = nullptr;  // RoPE positions; default n_past + i (chain) / n_past + depth (tree)
    const uint8_t * mask      = nullptr;  // [n, n]: token i sees batch token j iff mask[i*n + j] != 0;
                                          // attention-only models (a recurrent state follows parents only)
    const int32_t * parents   = nullptr;  // a tree: parent row of each row (-1: the committed past), parents
                                          // before children; a row sees its ancestors and itself
    bool whole = false;  // a chain that will be committed whole (a prefill micro-batch): a hybrid model then
                         // keeps the final recurrent state only, not one per token
};

class session {
  public:
    session(std::shared_ptr<const target_model> model, const session_params & params);
    ~session();
    session(const session &)             = delete;
    session & operator=(const session &) = delete;

    // Evaluate n tokens into the cache slots after n_past (every token sees the committed past). capture_layers:
    // layer-input indices whose hidden states are kept: read back to the host ([n, n_embd] each, captured()) or,
    // with rings, written by the graph itself into ring rows ring->slot(n_past + eval_slot(i)) (the layers side
    // by side in each row; several rings take consecutive layers of the list), never leaving the device.
    void eval(const int32_t * tokens, int n, const batch_layout & layout, const readout & what,
              const std::vector<int> & capture_layers = {}, const ring_set & rings = {});
    // keep the first n tokens of the last eval as committed (a chain prefix)
    void commit(int n);
    // keep the batch rows `rows` of the last eval, in order, as the next committed tokens: a path from a
    // depth-0 row down the tree (or a chain prefix); their KV rows move to consecutive slots, the recurrent
    // state becomes that of the last row. Attention-only models accept any increasing rows whose positions
    // continue the committed ones.
    void commit(const std::vector<int> & rows);
    // forget committed tokens from position n_past on (recurrent models: only back to 0, i.e. a reset)
    void truncate(int n_past);

    // The prompt cache (decode/driver.cpp prefill). A prefill evaluates its prompt in micro-batches that start at
    // multiples of n_ubatch, so a prompt's cache rows and last logits never depend on what was cached before it,
    // and marks two points: `aligned`, where its last whole micro-batch ended (a prompt sharing that prefix
    // computes the rows before it the same way), and, with `whole`, its end (the same prompt again needs no
    // evaluation, given the argmax `next` its last token read). Hybrid models keep their recurrent state at both
    // points. Truncating below a point forgets it.
    struct prefill_marks {
        std::vector<int32_t> prompt;
        int                  aligned = 0;
        bool                 whole   = false;
        int32_t              next    = -1;
        std::vector<float>   next_logits;  // the logits `next` was picked from (sampling draws from them)
    };
    const prefill_marks & prefill_cache() const { return marks_; }
    // a prefill of `prompt` continues from position `from` (0, or a point resume_prefill went back to)
    void begin_prefill(const std::vector<int32_t> & prompt, int from);
    // the committed tokens are the first n of the prompt, n a multiple of n_ubatch / all of it (argmax `next`)
    void mark_aligned(int n);
    void mark_whole(int32_t next, std::vector<float> next_logits);
    // back to a mark (or, attention-only models, any multiple of n_ubatch below `aligned`; 0: empty): the cache
    // is cut back to n tokens and a hybrid model's recurrent state restored
    void resume_prefill(int n);
    // Compute buffer bytes an evaluation of n_tokens over a window of n_kv cache slots (a multiple of
    // KV_WINDOW_STEP, or n_ctx) would need (ggml's allocator over its graph, nothing allocated): a chain
    // (tree_levels empty; `whole`: committed whole) or a tree of those levels, reading `what`, capturing into
    // `rings` as eval() would. For memory plans: the allocator packs each window's graph differently, so the
    // largest need is not always the widest window's.
    size_t measure_eval(int n_tokens, int n_kv, const std::vector<int> & tree_levels, bool whole,
                        const readout & what, const std::vector<int> & capture_layers, const ring_set & rings);
    // the attended window grows in steps of kv_window_step() cache slots (one graph per step): KV_WINDOW_STEP
    // where the target computes on the CPU, KV_WINDOW_STEP_GPU where it computes on a GPU (session.cpp says why)
    static constexpr int KV_WINDOW_STEP     = 64;
    static constexpr int KV_WINDOW_STEP_GPU = 256;
    int                  kv_window_step() const;
    // the compute buffer its graphs share, as allocated so far
    device_bytes compute_memory() const;
    // hybrid models: the compute buffer of the graphs that recompute a commit's recurrent state (its own), as
    // allocated so far, and the most it needs (ggml's allocator, nothing allocated); none without recurrent layers
    device_bytes commit_compute_memory() const { return rs_ ? rs_->commit_compute_memory() : device_bytes{}; }
    size_t       measure_commit() { return rs_ ? rs_->measure_commit() : 0; }
    device_bytes kv_memory() const { return kv_->memory(); }
    device_bytes recurrent_memory() const { return rs_ ? rs_->memory() : device_bytes{}; }
    bool   is_recurrent() const { return rs_ != nullptr; }
    // some of the target's layers compute on a GPU (or an RPC device): evaluation graphs are captured there, and
    // a verify's time hardly grows with its width (decode/cost_model.h, grid widths)
    bool   computes_on_gpu() const;
    size_t recurrent_bytes() const { return rs_ ? rs_->n_bytes() : 0; }

    int      n_past() const { return n_past_; }
    uint32_t n_ctx() const { return kv_->n_ctx(); }
    uint32_t n_ubatch() const { return n_ubatch_; }
    // a new prefill micro-batch (at most n_ctx): the prompt cache's marks, made with the old one, are forgotten;
    // a smaller one also frees the compute buffer (it regrows to the graphs that then run)
    void     set_n_ubatch(uint32_t n);
    uint32_t n_rollback() const { return rs_ ? rs_->n_rollback() : n_ctx(); }
    size_t   kv_bytes() const { return kv_->n_bytes(); }

    // results of the last eval, by batch row (the last row only without readout::all_rows)
    int                          n_outputs() const { return n_outputs_; }
    const std::vector<int32_t> & argmax() const { return argmax_; }
    // with readout::logits: the full logits, [n_outputs, n_vocab] row-major, read back from the device when
    // first asked for (a decode step that reads one row or none copies no more)
    const std::vector<float> &   logits() const;
    // row i's logits ([n_vocab]), read back alone; valid until the next call or eval
    const float *                logits_row(int i) const;
    int                          top_k() const { return top_k_; }
    const std::vector<int32_t> & top_ids() const { return top_ids_; }       // [n_outputs, k], most likely first
    const std::vector<float> &   top_logprobs() const { return top_logprobs_; }
    const std::vector<float> &   captured(size_t c) const { return captured_[c]; }  // [n, n_embd]
    // where batch row i of the last eval went: cache slot n_past + eval_slot(i) (tree evaluations of recurrent
    // models run their nodes depth by depth)
    int eval_slot(int i) const { return slot_of_.empty() ? i : slot_of_[i]; }
    int n_pending() const { return (int) pending_.size(); }  // rows of the last eval, not yet committed

    const target_model &         model() const { return *model_; }
    const std::shared_ptr<const target_model> & shared_model() const { return model_; }
    // the backends and CPU thread pool this session computes with (a draft session for it may share them)
    const std::shared_ptr<compute_backends> & compute() const { return compute_; }
    const std::vector<int32_t> & tokens() const { return tokens_; }  // committed token ids
    const kv_cache &             kv() const { return *kv_; }
    const recurrent_state *      recurrent() const { return rs_.get(); }

    std::atomic<bool> abort{false};  // checked between graph computes

  private:
    friend class session_batch;  // evaluates several sessions' rows in one graph, through the steps below
    struct graph_key {
        int              n_tokens = 0;
        int              n_kv     = 0;
        readout          what;
        std::vector<int> capture;
        std::array<uint64_t, ring_set::MAX_RINGS> ring_ids{};  // the feature rings written (0: none)
        std::vector<int> tree_levels;
        bool             whole = false;  // hybrid chains: committed whole (no steps kept for a partial commit)
        bool operator==(const graph_key & o) const {
            return n_tokens == o.n_tokens && n_kv == o.n_kv && what.all_rows == o.what.all_rows &&
                   what.logits == o.what.logits && what.top_k == o.what.top_k && capture == o.capture &&
                   ring_ids == o.ring_ids && tree_levels == o.tree_levels && whole == o.whole;
        }
    };
    struct compiled_graph;
    // what an evaluation of n_tokens over n_kv slots computes (tree_levels: nodes per depth of a recurrent tree,
    // else empty; whole: a chain committed whole), which names its graph
    graph_key key_for(int n_tokens, int n_kv, const std::vector<int> & tree_levels, bool whole, const readout & what,
                      const std::vector<int> & capture_layers, const ring_set & rings) const;
    // makes cur_ the graph for `key` (writing captures into `rings`), building it if no cached one has it
    void prepare_graph(const graph_key & key, const ring_set & rings);
    // builds the graph for `key` into g
    void build_graph(compiled_graph & g, const graph_key & key, const ring_set & rings);
    // the graph inputs for `key`: the batch's (tokens, positions), the KV cache's and the recurrent state's
    eval_inputs new_inputs(ggml_context * ctx, const graph_key & key) const;
    // the KV cache's and the recurrent state's inputs for `key`, and the tensors of both (state_tensors)
    void add_memory_inputs(ggml_context * ctx, const graph_key & key, kv_inputs & kv,
                           recurrent_inputs & recurrent) const;
    void fill_state(state_tensors & st) const;
    // the head over g.out.hidden: what `what` reads back
    void add_head(ggml_context * ctx, ggml_cgraph * gf, compiled_graph & g, const readout & what) const;
    // Where this session's rows sit in an evaluation graph (its own, or a batch's over several sessions): rows
    // [first, first + n) of the graph's tokens and positions (n_total rows in all), its memory's inputs
    struct row_inputs {
        ggml_tensor *            tokens    = nullptr;
        ggml_tensor *            positions = nullptr;
        int                      first     = 0;
        int                      n_total   = 0;
        const kv_inputs *        kv        = nullptr;
        const recurrent_inputs * recurrent = nullptr;
        ring_set::writes         ring_rows;  // the feature-ring rows written (none: nullptr)
    };
    // Where the results of the last eval are: the head outputs of its graph (a batch's: this session's n_rows
    // rows from first_row on; tokens from first_token on in the captured layers, read back unless a ring took
    // them). Valid until that graph computes again.
    struct result_tensors {
        ggml_tensor *              argmax       = nullptr;
        ggml_tensor *              logits       = nullptr;
        ggml_tensor *              top_ids      = nullptr;
        ggml_tensor *              top_logprobs = nullptr;
        std::vector<ggml_tensor *> captured;
        int64_t                    first_row   = 0;
        int64_t                    n_rows      = 0;
        int64_t                    first_token = 0;
    };
    // eval's steps: typed errors for a batch that cannot be evaluated, its rows ordered (`order`), an uncommitted
    // eval rolled back and its results forgotten (returns the key of the graph); the inputs of its rows (returns
    // the tokens by slot); after the compute, its rows pending and its results read back
    graph_key stage(const int32_t * tokens, int n, const batch_layout & layout, const readout & what,
                    const std::vector<int> & capture_layers, const ring_set & rings, batch_order & order);
    void check_batch(const int32_t * tokens, int n, const batch_layout & layout, const readout & what,
                     const std::vector<int> & capture_layers, const ring_set & rings) const;
    std::vector<int32_t> set_inputs(const int32_t * tokens, int n, const batch_layout & layout,
                                    const batch_order & order, const ring_set & rings, const row_inputs & where);
    void take_results(std::vector<int32_t> tokens_by_slot, bool tree, bool whole, int n, const readout & what,
                      result_tensors results);
    void read_outputs(int n, const readout & what);
    void read_top_k(int n_rows);
    void read_captured(int n);
    // the recurrent state as of before the last (uncommitted) eval
    void rollback_pending();
    // the prompt cache's marks at or beyond n_past no longer hold
    void forget_marks_from(int n_past);
    // keeps the first n committed tokens (their state already restored by the caller) and drops what is pending
    void cut_history_to(int n);

    std::shared_ptr<const target_model> model_;
    // this session's own (sessions over one model run in parallel), shared with its draft session: one
    // conversation computes on one thread pool
    std::shared_ptr<compute_backends>   compute_;
    graph_arena                         arena_;  // the compute buffer every graph below is placed in
    std::unique_ptr<kv_cache>           kv_;
    std::unique_ptr<recurrent_state>    rs_;
    uint64_t                            id_;  // unique among sessions: a batch's graph names the sessions it serves
    int                                 n_past_ = 0;
    uint32_t                            n_ubatch_;
    prefill_marks                       marks_;

    // the evaluation graphs, one per key (batch size, KV window, outputs, tree shape), the most recently used
    // kept: alternating widths (auto's rounds, plain steps between them) costs no rebuild
    struct compiled_graph {
        explicit compiled_graph(graph_arena & arena) : cache(arena) {}
        graph_cache   cache;
        graph_key     key;
        eval_inputs   in;
        eval_outputs  out;
        ggml_tensor * argmax       = nullptr;  // I32 [n_outputs]
        ggml_tensor * logits       = nullptr;  // F32 [V, n_outputs]
        ggml_tensor * top_ids      = nullptr;  // I32 [k, n_outputs]
        ggml_tensor * top_logprobs = nullptr;  // F32 [k, n_outputs]
        ring_set::writes ring_slots;           // I64 [n_tokens] each: feature-ring rows written (with rings)
        uint64_t      last_use     = 0;
    };
    std::vector<std::unique_ptr<compiled_graph>> graphs_;
    compiled_graph *                             cur_  = nullptr;  // the graph of the last eval
    uint64_t                                     uses_ = 0;

    std::vector<int32_t>            tokens_;      // committed token ids
    std::vector<int32_t>            pending_;     // token ids of the last eval by slot, until commit
    std::vector<int32_t>            pending_pos_; // their positions
    std::vector<int32_t>            parent_slot_; // tree evals: parent slot of each slot (-1: committed past)
    std::vector<int32_t>            slot_of_;     // batch row -> slot (empty: the identity)
    bool                            pending_tree_    = false;  // the last eval ran the tree graph
    bool                            pending_parents_ = false;  // the last eval's batch was a tree
    bool                            pending_whole_   = false;  // a hybrid chain committed whole (graph_key::whole)
    result_tensors                  results_;
    int                             n_outputs_    = 0;
    int                             top_k_        = 0;
    std::vector<int32_t>            argmax_;
    mutable std::vector<float>      logits_;       // read back on demand
    mutable bool                    logits_read_ = false;
    mutable std::vector<float>      logits_row_;
    std::vector<int>                output_rows_;  // the computed row holding output i
    std::vector<int32_t>            top_ids_;
    std::vector<float>              top_logprobs_;
    std::vector<std::vector<float>> captured_;
};

}  // namespace pdf
