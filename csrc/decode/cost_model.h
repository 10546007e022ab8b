// What a round of speculation costs on this machine and model: the time of a target evaluation per batch width
// (chain and tree graphs), measured once and refined online, and the rate speculation has been reaching (the
// drafter's time is in it; it is also kept on its own, for the timings). decode/proposer.cpp weighs it against
// decode/acceptance_model.h to choose, each round, what to verify.
#pragma once

#include <vector>

namespace pdf {

class cost_model {
  public:
    // widths at which evaluation time is measured (1 = a plain decoding step), up to max_width
    explicit cost_model(int max_width);

    int  max_width() const { return max_width_; }
    bool calibrated() const { return calibrated_; }
    void set_calibrated() { calibrated_ = true; }
    const std::vector<int> & grid() const { return grid_; }

    // ms of one target evaluation of n tokens: a chain, or a tree (recurrent targets run trees depth by depth)
    double verify_ms(int n, bool tree) const;
    double draft_ms() const { return draft_ms_; }
    // tokens per ms of plain decoding
    double plain_rate() const { return 1.0 / verify_ms(1, false); }

    // calibration: the time of one evaluation of n tokens (a grid width), chain or tree graph
    void calibrate_verify(int n, bool tree, double ms);
    // a round's measurements: each moves the times of the grid widths around its width (a running average,
    // through the calibrated shape between them), so the widths rounds use stay current and the others keep
    // their calibrated times.
    void observe_verify(int n, bool tree, double ms);
    void observe_draft(double ms);

    // realised speculative rate (tokens per ms, the whole round), exponentially averaged; 0 before any. fresh:
    // this round starts a new run of speculation (the first after plain decoding) and counts more
    double spec_rate() const { return spec_rate_; }
    void   observe_spec_round(int committed, double ms, bool fresh = false);

  private:
    int                 grid_index(int n) const;
    std::vector<int>    grid_;
    std::vector<double> chain_ms_, tree_ms_;
    std::vector<bool>   chain_seen_, tree_seen_;
    int                 max_width_;
    bool                calibrated_ = false;
    double              draft_ms_   = 0.0;
    bool                draft_seen_ = false;
    double              spec_rate_  = 0.0;
};

}  // namespace pdf
