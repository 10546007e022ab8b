// What a batched step (state/eval_batcher.h) costs by its parts and rows, how its time is split among its parts so
// that each generation's cost model (decode/cost_model.h) weighs what its rows add to the batch, and what the
// batch's planner (state/step_plan.h) expects a step to cost.
//
// A step's time depends on its rows R and its parts P (each part's attention is a set of graph nodes of its own),
// and not smoothly on R: the CPU's quantized matmuls take rows four or eight at a time, so a step of 11 rows can
// cost more than one of 12. Times are therefore kept for each (P, R) measured: the faster of its first two
// steps (the first builds the graph), then a running average.
//
// Split: a step of P parts and R rows (R >= P: a plain step is one row, a verify its width) took T ms. Had every
// part been one row, it would have taken base = T(P, P). Each part is charged base / P, and the time its rows
// beyond the first add, (T - base) * (n - 1) / (R - P): the extra time shared by the extra rows. The charges add
// up to T. A generation that decodes plainly pays its share of a plain batch; one that verifies w rows pays as
// well what they add to the step's time (the marginal cost, not the average of a step whose fixed cost its rows
// would otherwise dilute), so its own judgement of whether its drafting pays (decode/proposer.h) weighs what its
// speculation costs the batch.
#pragma once

#include <map>
#include <vector>

namespace pdf {

class step_times {
  public:
    // the ms charged to each part of a step of parts with these rows (each >= 1) that took ms, from what earlier
    // steps measured; then this step's time is learnt (learn: a step of decoding parts only; a prompt
    // micro-batch's rows cost differently, and the plans are for decoding steps)
    std::vector<double> split(const std::vector<int> & rows, double ms, bool learn);

    // ms of a step of `parts` parts and `rows` rows: as measured with that many parts, between the row counts
    // measured linearly, below them in proportion to the rows, above them as the most rows measured (optimistic:
    // a step planned there measures it). < 0 when no step of `parts` parts was measured.
    double estimate(int parts, int rows) const;
    // the most rows a step of `parts` parts was measured with (0: none)
    int    widest(int parts) const;
    // ms of a step of `parts` parts and `rows` rows measured at least twice (the first step of a shape builds its
    // graph), or < 0
    double settled(int parts, int rows) const;
    // ms of plain decoding for `parts` parts of one row each: the cheaper of one step together and, where a part
    // alone was measured (settled(1, 1)), `parts` steps of a part alone one after another (state/eval_batcher.h
    // runs it so where that is cheaper); < 0 when neither is known
    double plain_step(int parts) const;

    // Kept across processes (pydflash/cost_cache.py): the time of every measured step shape, parts -> rows -> ms,
    // and a table saved so, each time then averaged with the steps measured here as a step measured twice is
    // (a restored one is not a first step, which builds its graph). Throws std::invalid_argument for a shape no
    // step has (parts < 1, rows < parts or past MAX_ROWS) or a time that is not a positive number.
    static constexpr int                 MAX_ROWS = 1 << 16;
    std::map<int, std::map<int, double>> measured() const;
    // how many step shapes it holds times for (what measured() would list)
    int                                  shapes() const;
    void                                 restore(const std::map<int, std::map<int, double>> & table);

  private:
    // running averages by row count (0: not measured)
    struct by_rows {
        std::vector<double> ms;
        std::vector<int>    seen;  // steps measured, up to 2
        double              estimate(int rows) const;
        int                 widest() const;
        void                observe(int rows, double ms);
    };
    std::map<int, by_rows> by_parts_;
};

}  // namespace pdf
