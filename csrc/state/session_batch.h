// One target evaluation over several sessions of one model (continuous batching, decode/batch_driver.h). Every
// session's rows go through the weights together, one matmul per weight for all of them, while each session's
// attention, recurrent state, feature capture and readback stay its own (models/sequences.h): a session's rows
// come out as they would in an evaluation of its own. Afterwards each session holds its results and commits as
// after its own eval().
//
//   session_batch batch(model);
//   batch.eval({{&a, toks_a, 1, {}, read_argmax_last}, {&b, toks_b, 8, tree_b, read_logits_all}});
//   a.commit(1);  b.commit(rows);   // each as after a.eval(...) / b.eval(...)
#pragma once

#include "core/graph_cache.h"
#include "state/session.h"

#include <memory>
#include <vector>

namespace pdf {

class session_batch {
  public:
    // computes with backends and a compute buffer of its own (the model's CPU threads, core/backend.h)
    explicit session_batch(std::shared_ptr<const target_model> model);
    ~session_batch();
    session_batch(const session_batch &)             = delete;
    session_batch & operator=(const session_batch &) = delete;

    // one session's part: what session::eval takes
    struct part {
        session *        s      = nullptr;
        const int32_t *  tokens = nullptr;
        int              n      = 0;
        batch_layout     layout;
        readout          what;
        std::vector<int> capture;  // layer-input indices kept (into `rings`, else read back)
        ring_set         rings;
    };
    // evaluates every part in one graph. The sessions are distinct, over this batch's model; parts that read
    // top-k read the same k; their order does not matter (they run in their sessions' order: one graph for any
    // order). Each session's results are readable until this batch evaluates again. A typed error (as
    // session::eval's) leaves every session with nothing pending.
    void eval(const std::vector<part> & parts);

    // Compute buffer bytes one evaluation of these parts would need (ggml's allocator over its graph, nothing
    // allocated; for memory plans): each part n_tokens rows of session s over n_kv of its cache slots, a chain
    // (tree_levels empty; whole: committed whole) or a tree of those levels, reading `what`, capturing into
    // `rings`. A session may stand for several parts of its shape.
    struct shape {
        session *        s        = nullptr;
        int              n_tokens = 0;
        int              n_kv     = 0;
        std::vector<int> tree_levels;
        bool             whole = false;
        readout          what;
        std::vector<int> capture;
        ring_set         rings;
    };
    size_t measure(const std::vector<shape> & shapes);

    const std::shared_ptr<compute_backends> & compute() const { return compute_; }
    device_bytes                              compute_memory() const { return arena_.memory(); }

  private:
    struct compiled;
    struct key_entry {
        uint64_t           session_id;
        session::graph_key key;
        bool operator==(const key_entry & o) const { return session_id == o.session_id && key == o.key; }
    };
    // the cached graph for these parts, built if none is
    compiled & graph_for(const std::vector<part> & parts, const std::vector<key_entry> & keys);
    void       build(compiled & g, const std::vector<part> & parts);
    void       add_parts(ggml_context * ctx, compiled & g, const std::vector<part> & parts);
    void       add_captures(ggml_context * ctx, ggml_cgraph * gf, compiled & g, const std::vector<part> & parts);
    // after the compute: each session's results
    void       hand_out(compiled & g, const std::vector<part> & parts, std::vector<batch_order> & orders,
                        std::vector<std::vector<int32_t>> & tokens_by_slot);

    std::shared_ptr<const target_model>    model_;
    std::shared_ptr<compute_backends>      compute_;
    graph_arena                            arena_;
    std::vector<std::unique_ptr<compiled>> graphs_;
    uint64_t                               uses_ = 0;
};

}  // namespace pdf
