// What a round of speculation costs on this machine and model: the time of a target evaluation per batch width
// (chain and tree graphs) and the rate speculation has been reaching (the drafter's time is in it; it is also kept
// on its own, for the timings). decode/proposer.cpp weighs it against decode/acceptance_model.h to choose, each
// round, what to verify.
//
// Nothing is measured up front: the decode loop (decode/driver.cpp) times every round it runs and reports it
// here, so a fresh process decodes at once. Widths are learnt as rounds use them, from plain decoding up: a width
// wider than every measured one is taken, optimistically, to cost what the widest measured one does on a GPU and
// that times the square root of the widths' ratio on the CPU (one between measured widths is interpolated), so
// auto tries the widths that would pay most and measures them in the rounds that run them; an exploring round
// counts in the speculative rate as any other (observe()). (A cap at one grid step past the widest measured width
// let auto stall at narrow widths, where a draft costs more than it saves.) What was learnt can be saved
// (measured()) and given to a later process (restore()).
#pragma once

#include <algorithm>
#include <vector>

namespace pdf {

class cost_model {
  public:
    // widths at which evaluation time is kept (1 = a plain decoding step), up to max_width: each width up to
    // DENSE_WIDTHS, powers of two past it. On the CPU a verify's time grows in steps, not smoothly: ggml's
    // repacked matmul kernels take rows four at a time, so on a 0.3B-cost qwen35 q4mix target 2 rows took 20 ms,
    // 3 rows 31, 4 rows 32, 5 rows 43 and 8 rows 58. Kept at powers of two only, the times between were a line
    // that the observations there bent: 4 rows were learnt at 39 ms, and auto verified 3 or 6 where 4 cost the same
    // or paid more.
    static constexpr int DENSE_WIDTHS = 16;
    explicit cost_model(int max_width);

    int                      max_width() const { return max_width_; }
    const std::vector<int> & grid() const { return grid_; }
    // the widest width, up to n, that a round may verify with grid widths (a power of two, or max_width)
    int                      widest_verifiable(int n) const;
    // every grid width's chain time is measured
    bool                     calibrated() const;
    // the widest grid width whose chain time is measured (0: none)
    int                      widest_measured_chain() const;

    // Whether a round may verify n of its n_max proposed nodes. Each width is a graph of its own, kept among a
    // few (state/session.cpp); on a GPU a graph runs fast once the backend has captured it (CUDA graphs: after
    // two identical evaluations), and a rebuilt one starts over. auto choosing among every width rebuilt a graph
    // in 41% of its evaluations on an H100 (a 0.3B hybrid), 5% with grid widths. So on a GPU (grid_widths)
    // rounds verify widths of a power of two (or max_width) or all n_max nodes: there a few more nodes cost next to
    // nothing. On the CPU time grows with the width, in whole row tiles where the target's kernels take rows so
    // (set_row_tile, models/model.h verify_row_tile): there a round verifies a whole number of tiles, all n_max
    // nodes, or the root alone. (Any width taken, auto on the qwen35 q4mix target at width 768 verified 15 rows
    // at 38 ms beside the 16 that cost 28, its learnt time of 15 bounded by that of 16: 30 of 117 rounds were of
    // such widths. Whole tiles: 1.03-1.12x the decode rate with DFlash and DFlash2 drafters.)
    // On a GPU auto's drafter also proposes chains, not trees: a tree's shape (nodes per depth) is a graph of its
    // own, so nearly every tree verify builds one and runs it uncaptured, and the graphs it builds push the
    // chains' out of the few kept. Trees lost there in every run (tree 16 at 0.61-0.77x plain against chains'
    // 1.6-2.2x, an H100 and an H200), and auto with trees lost to plain decoding (0.73x on a MoE pair, 0.87x on
    // a dense one, an H200: 0.46 graph builds per evaluation); what a tree's build does to the chains after it is
    // not a cost this model can see.
    void set_grid_widths(bool on) { grid_widths_ = on; }
    bool grid_widths() const { return grid_widths_; }
    void set_row_tile(int rows) { row_tile_ = std::max(rows, 1); }
    int  row_tile() const { return row_tile_; }
    bool verifiable(int n, int n_max) const;
    // tests and benchmarks: every generation from now on with grid widths (1) or without (0); -1: as its target
    // computes (decode/stream.cpp)
    static void force_grid_widths(int on);
    static int  forced_grid_widths();

    // ms of one target evaluation of n tokens: a chain, or a tree (recurrent targets run trees depth by depth)
    double verify_ms(int n, bool tree) const;
    double draft_ms() const { return draft_ms_; }
    // tokens per ms of plain decoding
    double plain_rate() const { return 1.0 / verify_ms(1, false); }
    bool   knows_plain_step() const { return chain_seen_[0]; }

    // a measured time of one evaluation of n tokens at a grid width (a restored table, a test's hand-made one)
    void calibrate_verify(int n, bool tree, double ms);
    // one round as the decode loop (decode/driver.cpp) measured it, waits for other sessions' computes left out
    struct round {
        int    width;      // tokens verified, the root included
        bool   tree;       // verified with the tree graph (a recurrent target's branching tree)
        double verify_ms;  // the evaluation and the walk down it
        bool   drafted;    // the proposer ran the drafter
        double draft_ms;   // the proposal: drafting and choosing
        int    committed;  // tokens the round committed
        double round_ms;   // the whole round
        bool   learning = false;  // chosen while what the target accepts was not learnt yet (not rated if it
                                  // verified drafts)
        bool   probe    = false;  // merged proposers' probe (not rated)
    };
    // The verify moves the times of the grid widths around its width (a running average, through the shape
    // between them, so the widths rounds use stay current); a grid width is measured by the faster of its first
    // two evaluations (the first also builds the graph), on a GPU (grid widths) the fastest of three (a CUDA graph
    // is captured at its second identical evaluation and replayed from the third: on an H200 a MoE verify of 8
    // took 95.7, 12.1 and 3.7 ms, a verify of 4 6.0, 9.9 and 2.0). A drafted
    // round moves the speculative rate, unless it probed or was chosen before acceptance was learnt (none was
    // chosen for a rate known to it; the first PRIOR_DECLINES of those that verified nothing only); the first
    // rated after a plain round starts a new run of speculation and counts more.
    void observe(const round & r);
    // realised speculative rate (tokens per ms, the whole round): committed tokens over time, each exponentially
    // averaged over rounds; 0 before any
    double spec_rate() const { return spec_ms_ > 0 ? spec_tokens_ / spec_ms_ : 0.0; }
    // whether the last observed round moved spec_rate (auto judges speculation on such rounds only)
    bool   rated_last_round() const { return rated_last_; }
    // that round's own rate (tokens per ms, the whole round) and time, and whether it began a fresh run of
    // speculation (a probe after plain decoding): a probe's first rounds are judged on their own rate
    // (decode/proposer.cpp judge_speculation)
    double last_round_rate() const { return last_rate_; }
    double last_round_ms() const { return last_ms_; }
    bool   last_round_fresh() const { return last_fresh_; }
    // the speculative rate of rounds that committed `tokens` in `ms` each on average, as if measured (a probe's
    // rounds, decode/proposer.cpp; a test's hand-made rate): the rounds after it average with it as with those
    void   set_spec_round(double tokens, double ms);

    // the measured grid widths and their times, chain and tree, to save and restore() later
    struct measurement {
        int    width;
        bool   tree;
        double ms;
    };
    std::vector<measurement> measured() const;
    void                     restore(const std::vector<measurement> & table);

  private:
    bool                grid_widths_ = false;
    int                 row_tile_    = 1;
    int                 grid_index(int n) const;
    // verify_ms from the measured grid widths of its kind alone (chain or tree)
    double              learnt_ms(int n, bool tree) const;
    void                observe_verify(int n, bool tree, double ms);
    void                observe_draft(double ms);
    // ms bounded by the other measured grid widths' times (v, seen: chain or tree) at grid width i
    double              plausible(const std::vector<double> & v, const std::vector<bool> & seen, int i, double ms) const;
    void                observe_spec_round(int committed, double ms, bool fresh);
    std::vector<int>    grid_;
    std::vector<double> chain_ms_, tree_ms_;
    std::vector<bool>   chain_seen_, tree_seen_;    // measured
    // evaluations of each grid width so far, up to the one its time is trusted from (trusted_after())
    std::vector<int>    chain_runs_, tree_runs_;
    int                 trusted_after() const;
    int                 max_width_;
    double              draft_ms_     = 0.0;
    bool                draft_seen_   = false;
    double              spec_tokens_  = 0.0;  // committed tokens and ms of speculative rounds, averaged
    double              spec_ms_      = 0.0;
    bool                last_drafted_ = false;
    bool                rated_last_   = false;
    double              last_rate_    = 0.0;
    double              last_ms_      = 0.0;
    bool                last_fresh_   = false;
    int                 declined_     = 0;  // rounds chosen before acceptance was learnt that verified no draft
    // such rounds left unrated before the next are (observe())
    static constexpr int PRIOR_DECLINES = 64;
};

}  // namespace pdf
